"""A draft model with a tokenizer of its own (speccomp/drafters/text_bridge.py, HF's universal assisted decoding): the
text goes through both tokenizers, only the target's tokens are emitted, greedy output is HF's own, drafts are really
accepted where the draft agrees with the target. The second tokenizers are built here with the `tokenizers` library
on the repository's own text (tests/data/long_text.txt)."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers.implementations import ByteLevelBPETokenizer

import speccomp
from speccomp.drafters.draft_model import CrossTokenizerDrafter
from speccomp.drafters.text_bridge import TextBridge
from speccomp.engine.runtime import EngineError
from speccomp.errors import OptionError, OptionTypeError
from tiny_models import keep_drafting, seeded_prompt, tiny_llama

TEXT = (Path(__file__).parent / "data" / "long_text.txt").read_text()
VOCAB = 96  # tiny_llama's


def word_tokenizer(permutation=None) -> Tokenizer:
    """Whole lowercase words of TEXT, one token each ([UNK] = 0): decoding joins words with spaces and encoding that
    text gives the same ids back. `permutation`: the same words under other ids (another tokenizer of the same text)."""
    words = list(dict.fromkeys(re.findall(r"[a-z]+", TEXT.lower())))[: VOCAB - 1]
    ids = list(range(1, VOCAB)) if permutation is None else permutation
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{w: i for w, i in zip(words, ids)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def byte_bpe(vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on TEXT: cuts the same text into quite different pieces than word_tokenizer."""
    tok = ByteLevelBPETokenizer()
    tok.train_from_iterator([TEXT], vocab_size=vocab_size, min_frequency=2, show_progress=False)
    return Tokenizer.from_str(tok._tokenizer.to_str())


def sentencepiece_style(vocab_size: int = 1000) -> Tokenizer:
    """A BPE in the layout of Llama-2's, Mistral's and TinyLlama's tokenizer.json: a word start is a "▁" the
    normalizer puts before every space and before the text itself; the decoder strips the text's first space."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")  # training only: pieces within words
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>"],
                                                        show_progress=False))
    tok.pre_tokenizer = None
    return tok


def permuted_copy(model, perm: list[int]):
    """`model` reading and writing token perm[i] where it read and wrote token i (embedding and LM head rows)."""
    draft = copy.deepcopy(model)
    index = torch.empty(len(perm), dtype=torch.long)
    index[torch.tensor(perm)] = torch.arange(len(perm))  # new row perm[i] = old row i
    with torch.no_grad():
        for weight in {id(w): w for w in (draft.get_input_embeddings().weight, draft.get_output_embeddings().weight)
                       }.values():
            weight.copy_(weight[index])
    return draft


def hf_greedy(model, ids, n, eos=None):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          pad_token_id=0, eos_token_id=eos)


def shuffled(n: int, seed: int, keep: int = 1) -> list[int]:
    """0..n-1 with every id from `keep` on shuffled (ids below `keep`, e.g. [UNK] or special tokens, stay)."""
    rest = torch.randperm(n - keep, generator=torch.Generator().manual_seed(seed)) + keep
    return list(range(keep)) + rest.tolist()


def test_the_bridge_maps_text_not_ids():
    """Two tokenizers of one text: the draft's prompt is the same text in its ids; a draft path comes back as the
    target's ids of the text it adds (here each word one token on both sides, under different ids)."""
    target, draft = word_tokenizer(), word_tokenizer(shuffled(VOCAB, 3)[1:])
    bridge = TextBridge(target, draft)
    words = target.encode("the lamp still turns").ids
    assert len(words) == 4 and 0 not in words
    context = bridge.to_draft(words[:2])
    assert context == draft.encode("the lamp").ids != words[:2]
    path = draft.encode("still turns").ids
    assert bridge.continuation(words[:2], context, path) == words[2:]
    parents, tokens = bridge.target_tree(words[:2], context, [-1, 0, 1, 0], [context[-1]] + path + path[:1], 8, 8)
    assert (parents, tokens) == ([-1, 0, 1], words[1:])  # the leaf "still" is a prefix of "still turns": merged


@pytest.mark.parametrize("tokenizer", ["byte-level BPE", "SentencePiece-style BPE"])
def test_a_path_of_the_target_own_next_tokens_maps_back_to_them(tokenizer):
    """Both sides one tokenizer: a draft path that is the text's own next tokens comes back as those tokens, after
    a root that starts a word or sits inside one (a SentencePiece tokenizer marks the start of every text it encodes
    as a word start: mapped after the root alone, 40% of these paths began with a spurious "▁")."""
    tok = byte_bpe(300) if tokenizer == "byte-level BPE" else sentencepiece_style()
    bridge, ids = TextBridge(tok, tok), tok.encode(TEXT[:2000]).ids
    steps = [i for i in range(4, len(ids) - 3) if bridge.to_draft(ids[:i + 1]) == ids[:i + 1]]  # canonical prefixes
    assert len(steps) > 0.9 * (len(ids) - 7)
    wrong = [i for i in steps if bridge.continuation(ids[:i + 1], ids[:i + 1], ids[i + 1:i + 4]) != ids[i + 1:i + 4]]
    assert wrong == [], [tok.id_to_token(t) for t in ids[wrong[0] - 1:wrong[0] + 4]]


@pytest.mark.parametrize("tree", [4, "dynamic:8:2"])
def test_the_target_under_other_token_ids_drafts_and_is_exact(tree):
    """The draft is the target itself reading another tokenizer's ids for the same words: its drafts, carried over
    as text, are the target's own next words, so they are accepted; the output is HF greedy's. The draft holds just
    the whole text (50 positions): it drafts to the end (a node at depth d needs d positions past the text, not a
    tree's worth: drafting stopped 65 positions early)."""
    target = tiny_llama(initializer_range=0.2)
    perm = shuffled(VOCAB, 5)
    draft = permuted_copy(target, perm)
    draft.config.max_position_embeddings = 50
    fast = speccomp.compile(target, drafter=draft, tree=tree, drafter_options={
        "target_tokenizer": word_tokenizer(), "draft_tokenizer": word_tokenizer(perm[1:])})
    assert isinstance(fast.drafter, CrossTokenizerDrafter)
    ids = seeded_prompt(10, VOCAB)
    assert torch.equal(fast.generate(ids, max_new_tokens=40), hf_greedy(target, ids, 40))
    stats = fast.last_stats
    assert stats["tau"] > 2 and stats["acceptance_by_depth"][0] > 0.8, stats


def test_a_draft_that_cuts_text_differently_is_exact():
    """Target: whole words over 96 ids; draft: a byte-level BPE of 300 ids (another vocabulary size, other pieces)
    and random weights: it drafts (trees of target ids reach the verifier) and the output is HF greedy's, greedy and
    with a chain, in one generation and in a batch of two."""
    target = tiny_llama(initializer_range=0.2)
    fast = speccomp.compile(target, drafter=tiny_llama(vocab_size=300), tree=3, drafter_options={
        "target_tokenizer": word_tokenizer(), "draft_tokenizer": byte_bpe(300)})
    drafted = []
    propose = fast.drafter.propose
    fast.drafter.propose = lambda ctx: drafted.append(propose(ctx)) or drafted[-1]
    ids = seeded_prompt(12, VOCAB)
    assert torch.equal(fast.generate(ids, max_new_tokens=24), hf_greedy(target, ids, 24))
    assert max(d.tree.size for d in drafted) > 1  # drafts were made and verified, in target ids
    batch = torch.cat([ids, seeded_prompt(12, VOCAB).flip(1)])
    out = fast.generate(batch, max_new_tokens=16)
    for row in range(2):
        assert torch.equal(out[row : row + 1], hf_greedy(target, batch[row : row + 1], 16))


def test_an_engine_carries_both_tokenizers(tmp_path):
    """Exported (ONNX Runtime), the engine drafts through the same text bridge with the two tokenizers it wrote beside
    draft_model.onnx: HF greedy's output in as many steps as torch's; a lost tokenizer file is named at load."""
    import numpy as np

    target = tiny_llama(initializer_range=0.2)
    perm = shuffled(VOCAB, 5)
    fast = speccomp.compile(target, drafter=permuted_copy(target, perm), tree=[[0], [0, 0], [0, 0, 0], [1]],
                            backend="onnxruntime", drafter_options={"target_tokenizer": word_tokenizer(),
                                                                    "draft_tokenizer": word_tokenizer(perm[1:])})
    path = fast.export(tmp_path / "engine")
    engine = speccomp.load(path)
    files = engine.manifest["drafter"]["options"]["tokenizers"]
    assert all((path / f).is_file() for f in files.values())
    ids = seeded_prompt(11, VOCAB)
    want = hf_greedy(target, ids, 32)
    assert torch.equal(fast.generate(ids, max_new_tokens=32), want)
    assert np.array_equal(engine.generate(ids.numpy(), max_new_tokens=32), want.numpy())
    assert engine.last_stats["steps"] == fast.last_stats["steps"] < 20  # the same drafts, really accepted
    (path / files["draft"]).unlink()
    with pytest.raises(EngineError, match="draft tokenizer .* is missing"):
        speccomp.load(path)


def cross_tokenizer_pvalue(draws: int) -> tuple[float, float]:
    """Chi-square p-value of the first two sampled tokens (the second verified with a draft through the text bridge)
    against the target's exact joint law, and the share of runs whose second token was an accepted draft."""
    from scipy.stats import chisquare

    target = tiny_llama(initializer_range=0.2)
    perm = shuffled(VOCAB, 5)
    fast = speccomp.compile(target, drafter=permuted_copy(target, perm), tree=3, drafter_options={
        "target_tokenizer": word_tokenizer(), "draft_tokenizer": word_tokenizer(perm[1:])})
    ids = seeded_prompt(10, VOCAB)
    with torch.no_grad():  # P(t1, t2) = p(t1) p(t2 | t1): one forward over the prompt followed by every t1
        first = torch.softmax(target(ids).logits[0, -1].double() / 0.7, -1)
        both = torch.cat([ids.repeat(VOCAB, 1), torch.arange(VOCAB)[:, None]], 1)
        joint = (first[:, None] * torch.softmax(target(both).logits[:, -1].double() / 0.7, -1)).flatten()
    counts, accepted = torch.zeros(VOCAB * VOCAB), 0
    for seed in range(draws):
        out = fast.generate(ids, max_new_tokens=3, do_sample=True, temperature=0.7, seed=seed)[0, ids.shape[1]:]
        counts[out[0] * VOCAB + out[1]] += 1
        accepted += fast.last_stats["steps"] < 3  # the step after the prefill emitted two tokens: a draft was taken
    likely = joint * draws >= 5
    observed = torch.cat([counts[likely], counts[~likely].sum()[None]]).double()
    expected = torch.cat([joint[likely], joint[~likely].sum()[None]]) * draws
    return chisquare(observed.numpy(), expected.numpy()).pvalue, accepted / draws


def test_sampling_with_another_tokenizer_keeps_the_targets_distribution():
    """Its drafts are point masses (q = 1): sampling accepts by the target's p alone. The first two sampled tokens
    (the second verified against a draft carried through text, accepted in a quarter of the runs) follow the target's exact
    joint law (chi-square over 600 seeded generations)."""
    p, accepted = cross_tokenizer_pvalue(600)
    assert accepted > 0.15, accepted  # measured 0.25: at temperature 0.7 the draw often leaves the draft's words
    assert p > 1e-3, p


def test_a_wrong_rule_fails_the_cross_tokenizer_sampling_test(monkeypatch):
    """The same test with the acceptance tested against the un-warped (temperature 1) probabilities
    (test_sampling.accept_at_temperature_one): it fails, so the test above can."""
    from test_sampling import accept_at_temperature_one

    monkeypatch.setattr(speccomp.runtime.decode, "sample_accept", accept_at_temperature_one)
    p, accepted = cross_tokenizer_pvalue(600)
    assert accepted > 0.15 and p < 1e-3, (p, accepted)  # measured p = 2e-23


def test_a_draft_with_its_own_tokenizer_is_autotuned_under_its_tokenizers():
    """autotune takes a draft LM with its tokenizers (its draft level timed in its own ids): the tree is stored under
    the draft's fingerprint and both tokenizers, so the same draft read through the target's ids is another
    tuning; compile(tree="auto") with the same tokenizers finds it (no warning about options) and is exact."""
    import warnings

    from speccomp.tuning.autotune import autotune, drafter_key

    target = tiny_llama(initializer_range=0.2)
    perm = shuffled(VOCAB, 5)
    draft = permuted_copy(target, perm)
    options = {"target_tokenizer": word_tokenizer(), "draft_tokenizer": word_tokenizer(perm[1:])}
    prompts = [torch.randint(3, VOCAB, (1, 10 + i), generator=torch.Generator().manual_seed(i)) for i in range(6)]
    tuned = keep_drafting(autotune(target, draft, prompts, drafter_options=options, max_new_tokens=24, repeats=1,
                                   max_nodes=8))
    assert "-tokens-" in tuned.drafter and tuned.drafter == drafter_key(draft, options) != drafter_key(draft, None)
    assert tuned.drafter_options == {"tokenizers": "own"} and tuned.timing["widths"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fast = speccomp.compile(target, drafter=draft, tree="auto", drafter_options=options)
    assert isinstance(fast.drafter, CrossTokenizerDrafter)
    ids = prompts[0]
    assert torch.equal(fast.generate(ids, max_new_tokens=24), hf_greedy(target, ids, 24))
    assert fast.last_stats["tau"] > 1.5, fast.last_stats
    with pytest.raises(OptionError, match="needs both"):  # its options are checked before any work
        autotune(target, draft, prompts, drafter_options={"draft_tokenizer": options["draft_tokenizer"]})


def test_a_checkpoint_directory_with_its_own_tokenizer_by_path(tmp_path):
    """The CLI's form: drafter="draft_model" with a save_pretrained directory whose vocabulary is not the target's and
    both tokenizers as tokenizer.json paths (a file, or the directory holding one): exact, drafts accepted."""
    target = tiny_llama(initializer_range=0.2)
    perm = shuffled(VOCAB, 5)
    permuted_copy(target, perm).save_pretrained(tmp_path / "draft")
    word_tokenizer(perm[1:]).save(str(tmp_path / "draft" / "tokenizer.json"))
    word_tokenizer().save(str(tmp_path / "target.json"))
    fast = speccomp.compile(target, drafter="draft_model", tree=4, drafter_options={
        "path": str(tmp_path / "draft"), "draft_tokenizer": str(tmp_path / "draft"),
        "target_tokenizer": str(tmp_path / "target.json")})
    assert isinstance(fast.drafter, CrossTokenizerDrafter)
    ids = seeded_prompt(10, VOCAB)
    assert torch.equal(fast.generate(ids, max_new_tokens=32), hf_greedy(target, ids, 32))
    assert fast.last_stats["acceptance_by_depth"][0] > 0.8, fast.last_stats
    with pytest.raises(OptionError, match="needs both"):
        speccomp.compile(target, drafter="draft_model", drafter_options={"path": str(tmp_path / "draft"),
                                                                         "draft_tokenizer": str(tmp_path / "draft")})
    # the CLI's form (`--drafter draft_model --drafter-options '{"path": DIR, "draft_tokenizer": DIR}'`): the loaded
    # model's own tokenizer becomes the target's
    from argparse import Namespace

    from transformers import PreTrainedTokenizerFast

    from speccomp.cli import _compile

    args = Namespace(drafter="draft_model", backend="eager", drafter_options={
        "path": str(tmp_path / "draft"), "draft_tokenizer": str(tmp_path / "draft")})
    cli = _compile(target, args, PreTrainedTokenizerFast(tokenizer_object=word_tokenizer()))
    assert isinstance(cli.drafter, CrossTokenizerDrafter)
    assert torch.equal(cli.generate(ids, max_new_tokens=32), hf_greedy(target, ids, 32))
    assert cli.last_stats["acceptance_by_depth"][0] > 0.8, cli.last_stats
    args = Namespace(drafter="draft_model+suffix", backend="eager", drafter_options={"draft_model": {
        "path": str(tmp_path / "draft"), "draft_tokenizer": str(tmp_path / "draft")}})  # inside a merge too
    merged = _compile(target, args, PreTrainedTokenizerFast(tokenizer_object=word_tokenizer()))
    assert torch.equal(merged.generate(ids, max_new_tokens=32), hf_greedy(target, ids, 32))
    assert merged.last_stats["tau"] > 2, merged.last_stats
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(OptionError, match="draft_tokenizer=.*bad.json'?: is not a tokenizers JSON file"):
        speccomp.compile(target, drafter="draft_model", drafter_options={
            "path": str(tmp_path / "draft"), "draft_tokenizer": str(tmp_path / "bad.json"),
            "target_tokenizer": str(tmp_path / "target.json")})


def test_a_named_draft_model_with_its_own_tokenizers_is_tuned_under_them(tmp_path, monkeypatch):
    """drafter="draft_model" by path with both tokenizers: autotune stored its own-tokenizers mark as an option, so
    compile(tree="auto") refused every call ('draft_model takes only path'). Now the tokenizers are in the key (never
    stored), the path is stored, and the same options find the tree: exact, drafts accepted."""
    from speccomp.tuning.autotune import AutotuneError, autotune, drafter_key

    monkeypatch.setenv("SPECCOMP_CACHE", str(tmp_path / "cache"))
    target = tiny_llama(initializer_range=0.2)
    perm = shuffled(VOCAB, 5)
    permuted_copy(target, perm).save_pretrained(tmp_path / "draft")
    word_tokenizer(perm[1:]).save(str(tmp_path / "draft" / "tokenizer.json"))
    word_tokenizer().save(str(tmp_path / "target.json"))
    options = {"path": str(tmp_path / "draft"), "draft_tokenizer": str(tmp_path / "draft"),
               "target_tokenizer": str(tmp_path / "target.json")}
    prompts = [torch.randint(3, VOCAB, (1, 10 + i), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    tuned = keep_drafting(autotune(target, "draft_model", prompts, drafter_options=options, max_new_tokens=16,
                                   repeats=1, max_nodes=6, mode="static"))
    assert tuned.drafter == drafter_key("draft_model", options) != "draft_model" and "-tokens-" in tuned.drafter
    assert tuned.drafter_options == {"path": str(tmp_path / "draft")}
    fast = speccomp.compile(target, drafter="draft_model", tree="auto", drafter_options=options)
    assert isinstance(fast.drafter, CrossTokenizerDrafter) and fast.drafter.tree.choices == tuned.tree
    ids = seeded_prompt(10, VOCAB)
    assert torch.equal(fast.generate(ids, max_new_tokens=24), hf_greedy(target, ids, 24))
    with pytest.raises(AutotuneError, match="no autotuned tree for drafter 'draft_model'"):  # another tuning
        speccomp.compile(target, drafter="draft_model", tree="auto", drafter_options={"path": options["path"]})


def test_bad_tokenizer_options_are_refused_by_name():
    target, other = tiny_llama(), tiny_llama(vocab_size=300)
    with pytest.raises(OptionError, match="draft_tokenizer"):  # another vocabulary, no tokenizers: the fix is named
        speccomp.compile(target, drafter=other)
    with pytest.raises(OptionError, match="needs both"):
        speccomp.compile(target, drafter=other, drafter_options={"draft_tokenizer": byte_bpe(300)})
    with pytest.raises(OptionError, match="exit_layer"):
        speccomp.compile(target, drafter=other, drafter_options={"exit_layer": 1})
    with pytest.raises(OptionTypeError, match="target_tokenizer"):
        speccomp.check_options(drafter=other, drafter_options={"draft_tokenizer": byte_bpe(300), "target_tokenizer": 2})
    with pytest.raises(OptionError, match="target_tokenizer='?gpt2'?: names no tokenizer.json"):  # a path, not a hub name
        speccomp.check_options(drafter=other, drafter_options={"draft_tokenizer": byte_bpe(300),
                                                               "target_tokenizer": "gpt2"})
    with pytest.raises(OptionError, match="not its tokenizer"):  # 300 ids do not fit a 96-token target
        speccomp.compile(target, drafter=other, drafter_options={"draft_tokenizer": byte_bpe(300),
                                                                 "target_tokenizer": byte_bpe(300)})


def smollm_with_fewer_merges(tokenizer, merges: int, seed: int) -> tuple[Tokenizer, list[int]]:
    """SmolLM2's byte-level BPE with only its first `merges` merges (words cut into more, shorter pieces) and its
    non-special ids shuffled: a tokenizer that shares no ids' meaning and few segmentations with the original."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    keep = 1 + max(t["id"] for t in spec["added_tokens"])  # special tokens keep their ids
    perm = shuffled(len(spec["model"]["vocab"]), seed, keep)
    spec["model"]["vocab"] = {t: perm[i] for t, i in spec["model"]["vocab"].items()}
    spec["model"]["merges"] = spec["model"]["merges"][:merges]
    return Tokenizer.from_str(json.dumps(spec)), perm


@pytest.mark.real_model
def test_smollm2_with_a_differently_tokenized_draft(smollm, smollm_captured, two_threads):
    """Real text: SmolLM2 drafts for itself through a tokenizer with a fifth of its merges and shuffled ids (its
    embedding rows shuffled to match). Words split differently, ids mean different things: the drafts that survive
    the round trip through text are accepted, and the reply is HF greedy's."""
    model, tok = smollm
    draft_tok, perm = smollm_with_fewer_merges(tok, 10_000, seed=7)
    fast = speccomp.compile(smollm_captured, drafter=permuted_copy(model, perm), tree=4, drafter_options={
        "target_tokenizer": tok, "draft_tokenizer": draft_tok})
    text = "The lighthouse on the northern edge of the island"
    assert len(draft_tok.encode(text).ids) > len(tok.encode(text))  # it really cuts text into more pieces
    ids = tok.apply_chat_template([{"role": "user", "content": "Name three colours of the rainbow."}],
                                  add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if not torch.is_tensor(ids) else ids
    out = fast.generate(ids, max_new_tokens=40, eos_token_id=tok.eos_token_id)
    assert torch.equal(out, hf_greedy(model, ids, 40, eos=tok.eos_token_id))
    assert fast.last_stats["acceptance_by_depth"][0] > 0.3 and fast.last_stats["tau"] > 1.5, fast.last_stats
