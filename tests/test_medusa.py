"""Medusa heads: graph pass, lossless decoding, training (resumable, seeded), checkpoint interop, errors."""
import copy
import json

import pytest
import torch

import speccomp
from speccomp.frontend import capture
from speccomp.frontend.graph import SpecGraph, run_passes
from speccomp.drafters.medusa import HeadsError, load_medusa, new_heads, save_medusa
from speccomp.passes.medusa_heads import MedusaHeadsPass
from speccomp.tuning.train_heads import distilled_text, head_accuracy, train_heads
from speccomp.errors import OptionError
from tiny_models import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(num_hidden_layers=3, initializer_range=0.2, tie_word_embeddings=True)


def random_heads(model, k=3, seed=0):
    heads = new_heads(model, k)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return heads.eval()


def prompts(n=6, seed=0, length=10):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (1, length), generator=g) for _ in range(n)]


def test_pass_golden_structure_and_numerics(model):
    heads = random_heads(model)
    base = SpecGraph.from_captured(capture(model))
    sg = run_passes(base.clone(), [MedusaHeadsPass(heads)])
    before, after = base.op_counts(), sg.op_counts()
    assert after["aten.linear.default"] == before["aten.linear.default"] + 3  # one ResBlock linear per head
    assert after["aten.silu.default"] == before["aten.silu.default"] + 3
    assert len(sg.gm.graph.output_node().args[0]) == 4
    ids = torch.randint(0, 96, (1, 5))
    kv = sg.captured.kv
    outs = sg.gm(ids, torch.arange(5)[None], torch.ones(1, 5, dtype=torch.long), torch.zeros(*kv.shape(0)))
    ref = base.gm(ids, torch.arange(5)[None], torch.ones(1, 5, dtype=torch.long), torch.zeros(*kv.shape(0)))
    assert all(torch.equal(a, b) for a, b in zip(outs[:3], ref))  # the model's outputs are untouched
    assert outs[3].shape == (1, 5, 3, 32)
    torch.testing.assert_close(outs[3], heads.states(ref[2]))  # states = ResBlocks(final hidden)
    with pytest.raises(Exception, match="applied twice|3 outputs"):
        MedusaHeadsPass(heads)(sg)


def test_medusa_greedy_identical(model, tmp_path):
    save_medusa(random_heads(model), tmp_path / "h")
    fast = speccomp.compile(model, drafter="medusa", drafter_options={"heads": str(tmp_path / "h")},
                            tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]])
    for ids in prompts(3, seed=4):
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False,
                             eos_token_id=2, pad_token_id=2)
        assert torch.equal(fast.generate(ids, max_new_tokens=30, eos_token_id=2), ref)
    with pytest.raises(ValueError, match="3 Medusa heads"):
        speccomp.compile(model, drafter="medusa", drafter_options={"heads": str(tmp_path / "h")}, tree=4)


def test_round_trip_bit_identical_both_layouts(model, tmp_path):
    heads = random_heads(model)
    for layout in (False, True):
        d = save_medusa(heads, tmp_path / f"l{layout}", medusa_layout=layout)
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["medusa_num_heads"] == 3 and cfg["medusa_num_layers"] == 1
        back = load_medusa(d, model)
        assert back.tied  # Medusa-layout projections equal to the LM head are recognised as tied
        for (n1, a), (n2, b) in zip(heads.state_dict().items(), back.state_dict().items()):
            assert n1 == n2 and torch.equal(a, b)
    from safetensors.torch import load_file, save_file

    # FasterDecoding/Medusa's own module loads the file as written, and speccomp loads what Medusa saves
    # (`save_file(medusa_head.state_dict())`: names without a prefix; speccomp's were "medusa_head."-prefixed, so
    # Medusa's load_state_dict(strict=False) kept none of them, and speccomp refused Medusa's file as corrupt)
    class ResBlock(torch.nn.Module):
        def __init__(self, hidden):
            super().__init__()
            self.linear = torch.nn.Linear(hidden, hidden)

    hidden, vocab = heads.hidden, heads.vocab
    medusa_head = torch.nn.ModuleList([torch.nn.Sequential(ResBlock(hidden), torch.nn.Linear(hidden, vocab, bias=False))
                                       for _ in range(3)])
    medusa_head.load_state_dict(load_file(str(tmp_path / "lTrue" / "medusa_lm_head.safetensors")), strict=True)
    assert torch.equal(medusa_head[1][0].linear.weight, heads.state_dict()["blocks.1.0.linear.weight"])
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    save_file(medusa_head.state_dict(), str(theirs / "medusa_lm_head.safetensors"))
    (theirs / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
    back = load_medusa(theirs, model)
    assert all(torch.equal(a, b) for a, b in zip(heads.state_dict().values(), back.state_dict().values()))
    older = load_file(str(tmp_path / "lFalse" / "medusa_lm_head.safetensors"))  # speccomp's earlier names load too
    save_file({f"medusa_head.{k}": v for k, v in older.items()}, str(tmp_path / "lFalse" / "medusa_lm_head.safetensors"))
    back = load_medusa(tmp_path / "lFalse", model)
    assert all(torch.equal(a, b) for a, b in zip(heads.state_dict().values(), back.state_dict().values()))


def test_bad_heads_are_refused(model, tmp_path):
    other = tiny_llama(hidden_size=48, num_attention_heads=4, num_key_value_heads=2)
    save_medusa(random_heads(other), tmp_path / "wrong")
    with pytest.raises(HeadsError, match="hidden size 48"):
        load_medusa(tmp_path / "wrong", model)
    save_medusa(random_heads(model), tmp_path / "corrupt")
    (tmp_path / "corrupt" / "medusa_lm_head.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(HeadsError, match="corrupt"):
        load_medusa(tmp_path / "corrupt", model)
    with pytest.raises(HeadsError, match="config.json"):
        load_medusa(tmp_path / "nothing", model)


def test_no_heads_error_says_how_to_train(model, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCOMP_CACHE", str(tmp_path))
    with pytest.raises(HeadsError, match="speccomp train-heads"):
        speccomp.compile(model, drafter="medusa")


def test_training_learns_resumes_and_is_seeded(model, tmp_path, monkeypatch):
    train = prompts(8, seed=1)
    kw = dict(num_heads=2, max_new_tokens=24, epochs=6, lr=3e-2, batch_size=32, seed=0, eos_token_id=None, progress=False)
    calls = {"n": 0}
    real_ce = torch.nn.functional.cross_entropy

    def counting_ce(*args, **kwargs):
        calls["n"] += 1
        if calls.get("stop") and calls["n"] > calls["stop"]:
            raise KeyboardInterrupt  # the user stops the run in the middle of epoch 2
        return real_ce(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "cross_entropy", counting_ce)
    a = train_heads(model, train, out=tmp_path / "a", **kw)
    per_epoch = calls["n"] // 6
    calls.update(n=0, stop=per_epoch + 1)
    with pytest.raises(KeyboardInterrupt):
        train_heads(model, train, out=tmp_path / "b", **kw)
    assert json.loads((tmp_path / "b" / "_train" / "progress.json").read_text())["epoch"] == 1
    calls.update(n=0, stop=None)
    b = train_heads(model, train, out=tmp_path / "b", **kw)  # resumes at epoch 2
    assert calls["n"] == 5 * per_epoch
    for x, y in zip(a.state_dict().values(), b.state_dict().values()):
        assert torch.equal(x, y)  # seeded and resumable: the same heads as the uninterrupted run
    # the heads learned the model's own continuations (the self-distilled training text)
    seqs, _ = distilled_text(tmp_path / "a")
    trained, untrained = head_accuracy(a, model, seqs), head_accuracy(new_heads(model, 2), model, seqs)
    assert all(t > u + 0.05 for t, u in zip(trained, untrained)), (trained, untrained)
    with pytest.raises(OptionError, match=r"other settings \(lr: 0.03 there, 1.0 now\); train with the same settings to "
                                          r"resume it, or into another folder \(out= / --out\)"):
        train_heads(model, train, out=tmp_path / "a", **{**kw, "lr": 1.0})
    # replies that stop at another eos are another training text (the run's stored replies were handed back)
    with pytest.raises(OptionError, match=r"other settings \(eos_token_id: \[\] there, \[80\] now\)"):
        train_heads(model, train, out=tmp_path / "a", **{**kw, "eos_token_id": 80})
    # a run stored before eos ids were recorded (the CLI always passes one) still resumes
    progress = tmp_path / "a" / "_train" / "progress.json"
    old = json.loads(progress.read_text())
    del old["args"]["eos_token_id"]
    progress.write_text(json.dumps(old))
    train_heads(model, train, out=tmp_path / "a", **{**kw, "eos_token_id": 80})
    # a finished run's folder is no cache for other prompts (as many) or another model: refused, never handed back
    with pytest.raises(ValueError, match="other settings"):
        train_heads(model, prompts(8, seed=2), out=tmp_path / "a", **kw)
    with pytest.raises(ValueError, match="other settings"):
        train_heads(tiny_llama(initializer_range=0.3), train, out=tmp_path / "a", **kw)


@pytest.mark.parametrize("bad, match", [
    (dict(epochs=0), "epochs"), (dict(num_heads=0), "num_heads"), (dict(lr=0.0), "lr"),
    (dict(batch_size=-1), "batch_size"), (dict(prompts=[]), "at least one prompt"),
    (dict(soft_labels=-1), "soft_labels"), (dict(soft_labels=True), "soft_labels"), (dict(soft_labels=2.0), "soft_labels"),
    (dict(soft_labels=97), "more than the model's vocabulary"), (dict(soft_labels=1), "argmax label again"),
    (dict(kind="hydra", draft_vocab=97), r"draft_vocab=97: is more than the model's vocabulary \(96 tokens\); use at"),
    (dict(kind="eagle", draft_vocab=0), "draft_vocab must be an int >= 1"),
    (dict(prompts=[torch.tensor([5, 500])]), r"prompts\[0\]=.*outside the model's vocabulary"),
    (dict(prompts=[[5, 6]]), r"prompts\[0\]=.*integer tensor"),
    (dict(num_heads=4, max_new_tokens=3), r"max_new_tokens=3: is shorter than num_heads=4"),
    # checked after the run folder existed (AdamW, manual_seed), or never: an infinite lr saved all-NaN heads
    (dict(lr=float("inf")), "lr=inf: must be a finite number > 0"),
    (dict(weight_decay=-1.0), r"weight_decay=-1.0: must be a finite number >= 0"),
    (dict(seed=1.5), "seed=1.5: must be an int"), (dict(seed="abc"), "seed='abc': must be an int"),
    (dict(seed=10**23), r"seed=100000000000000000000000: must be in \[0, 2\*\*63\)"),  # manual_seed overflowed
    (dict(eos_token_id="x"), "eos_token_id='x': must be a token id"),
    # failed after the replies and hidden states (hydra, eagle: the draft vocabulary), never stopped a reply (medusa)
    (dict(kind="hydra", eos_token_id=200), r"eos_token_id=200: token ids \[200\] are outside the model's vocabulary"),
    (dict(eos_token_id=[2, 96]), r"eos_token_id=\[2, 96\]: token ids \[96\] are outside"),
    # accepted and ignored by the API (the CLI refused the flags)
    (dict(kind="eagle", num_layers=3), "num_layers=3: does not apply to kind='eagle'"),
    (dict(kind="medusa", draft_vocab=10), "draft_vocab=10: does not apply to kind='medusa'"),
])
def test_training_rejects_bad_settings(model, tmp_path, bad, match):
    kw = {"prompts": prompts(2), "out": tmp_path / "x", "progress": False, **bad}
    with pytest.raises((ValueError, TypeError), match=match):
        train_heads(model, kw.pop("prompts"), **kw)
    assert not (tmp_path / "x").exists()  # nothing written before the settings are checked


def test_training_takes_eos_ids_as_generate_does():
    """The settings check refuses what is not a token id, but takes an int, numpy's ints and lists of them."""
    import numpy as np

    from speccomp.tuning.train_heads import check_training_numbers, eos_identity

    for eos, ids in ((None, []), (2, [2]), (np.int64(2), [2]), ([3, np.int32(2)], [2, 3])):
        check_training_numbers(1e-3, 0.0, 0, eos)
        assert eos_identity(eos) == {"eos_token_id": ids}
    for bad in ("x", [2, None], True, -1, 2.0):
        with pytest.raises(TypeError, match="eos_token_id="):
            check_training_numbers(1e-3, 0.0, 0, bad)


def test_replies_shorter_than_the_heads_are_named_and_the_corrected_rerun_runs(model, tmp_path):
    """Replies that stop at eos before num_heads tokens leave no training position: that raised a ValueError naming
    the wrong length after the run's state was written, so the rerun with another eos was refused as "other
    settings". It names num_heads now and leaves no state behind; no sampling-option warning on the greedy round."""
    import warnings

    prompt = torch.tensor([[5, 7, 9]])
    with torch.no_grad():
        first = int(model(prompt).logits[0, -1].argmax())  # the first reply token as eos: one-token replies
    kw = dict(kind="medusa", num_heads=2, max_new_tokens=8, epochs=1, progress=False)
    with pytest.raises(speccomp.OptionError, match=r"num_heads=2: is more than any reply holds: the longest reply has "
                       r"1 tokens after its prompt"):
        train_heads(model, [prompt], out=tmp_path / "h", eos_token_id=first, **kw)
    assert not (tmp_path / "h" / "_train").exists()
    from test_plain_module import NanoGPT, _init

    class GPT(NanoGPT):  # heads read the module's embeddings
        def get_output_embeddings(self):
            return self.lm_head

        def get_input_embeddings(self):
            return self.transformer.wte

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a plain module's greedy round passed temperature / seed it ignored
        train_heads(_init(GPT(), 1), [prompt], out=tmp_path / "plain", **kw)
    assert (train_heads(model, [prompt], out=tmp_path / "h", eos_token_id=None, **kw)).num_heads == 2


def test_a_refusal_after_the_replies_keeps_them_for_the_rerun(tmp_path):
    """Only replies too short for the heads clear the run's state: a refusal from compiling the model for its hidden
    states (here inference-mode parameters) keeps the distilled replies, so the corrected rerun resumes."""
    with torch.inference_mode():
        model = tiny_llama(num_hidden_layers=2)
    with pytest.raises(speccomp.OptionError, match="inference-mode parameters"):
        train_heads(model, prompts(2), out=tmp_path / "h", kind="medusa", num_heads=2, max_new_tokens=8, epochs=1,
                    progress=False)
    assert (tmp_path / "h" / "_train" / "tokens.safetensors").exists()


@pytest.mark.parametrize("damaged", ["tokens.safetensors", "checkpoint.safetensors"])
def test_a_damaged_run_state_is_named_with_the_fix(model, tmp_path, damaged):
    """A truncated checkpoint of an interrupted run failed its rerun with a bare SafetensorError naming no file."""
    import json

    kw = dict(kind="medusa", num_heads=2, max_new_tokens=12, epochs=2, progress=False)
    train_heads(model, prompts(2), out=tmp_path / "h", **kw)
    state = tmp_path / "h" / "_train"
    progress = json.loads((state / "progress.json").read_text())
    (state / "progress.json").write_text(json.dumps({**progress, "epoch": 1}))  # as if stopped after epoch 1
    (state / damaged).write_bytes((state / damaged).read_bytes()[:60])
    with pytest.raises(OptionError, match=rf"out=.*its training run's {damaged} is damaged .*delete .*_train"):
        train_heads(model, prompts(2), out=tmp_path / "h", **kw)


def test_a_run_cut_inside_its_checkpoint_resumes_to_the_heads_of_an_uncut_run(model, tmp_path, monkeypatch):
    """Heads, AdamW moments and the epoch count were three files renamed one after the other: a run stopped between
    them resumed with epoch 2's heads, epoch 1's count and trained epoch 2 again (other heads than an uncut run's)."""
    from safetensors.torch import load_file

    import speccomp.models

    kw = dict(kind="medusa", num_heads=2, max_new_tokens=12, epochs=3, progress=False)
    train_heads(model, prompts(2), out=tmp_path / "uncut", **kw)
    write = speccomp.models.write_atomically

    def cut(path, text):  # stopped after epoch 2's weights were written, before its progress
        if path.name == "progress.json" and '"epoch": 2' in text:
            raise KeyboardInterrupt
        write(path, text)

    monkeypatch.setattr(speccomp.models, "write_atomically", cut)
    with pytest.raises(KeyboardInterrupt):
        train_heads(model, prompts(2), out=tmp_path / "cut", **kw)
    monkeypatch.setattr(speccomp.models, "write_atomically", write)
    train_heads(model, prompts(2), out=tmp_path / "cut", **kw)
    uncut, cut = (load_file(str(tmp_path / d / "medusa_lm_head.safetensors")) for d in ("uncut", "cut"))
    assert uncut.keys() == cut.keys() and all(torch.equal(uncut[k], cut[k]) for k in uncut)


def test_a_cast_model_without_heads_is_told_where_the_float32_models_heads_are(model, tmp_path, monkeypatch):
    """Heads are stored under the float32 model's fingerprint; a bfloat16 copy has another, and the error's advice
    (train them) stored them where it could not look either."""
    from speccomp.drafters.head_drafters import heads_dir

    monkeypatch.setenv("SPECCOMP_CACHE", str(tmp_path))
    stored = save_medusa(random_heads(model), heads_dir(model))
    cast = copy.deepcopy(model).to(torch.bfloat16)
    with pytest.raises(HeadsError, match=rf"which a bfloat16 model does not have; heads stored here: \[.*'{stored}'"):
        speccomp.compile(cast, drafter="medusa")


# ---------------------------------------------------------------------------------------------
# Hydra heads (speccomp/drafters/hydra.py): sequential heads that read the previous token
# ---------------------------------------------------------------------------------------------
def random_hydra(model, k=3, seed=0, vocab=None):
    from speccomp.drafters.hydra import new_hydra

    heads = new_hydra(model, torch.arange(96) if vocab is None else vocab, k)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return heads.eval()


@pytest.mark.parametrize("tree", [[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], "dynamic:8:3"])
def test_hydra_greedy_identical(model, tmp_path, tree):
    from speccomp.drafters.hydra import save_hydra

    save_hydra(random_hydra(model, vocab=torch.arange(3, 80)), tmp_path / "h")  # a draft vocabulary subset
    fast = speccomp.compile(model, drafter="hydra", drafter_options={"heads": str(tmp_path / "h")}, tree=tree)
    steps = tokens = 0
    for ids in prompts(3, seed=5):
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False,
                             eos_token_id=2, pad_token_id=2)
        assert torch.equal(fast.generate(ids, max_new_tokens=30, eos_token_id=2), ref)
        steps, tokens = steps + fast.last_stats["steps"], tokens + fast.last_stats["new_tokens"]
    assert steps < tokens  # even random heads get some drafts accepted (measured: 86 and 85 steps for 90 tokens)


@pytest.mark.parametrize("backend", ["eager", "onnxruntime", "inductor"])
def test_hydra_head_step_is_a_lowered_graph(model, tmp_path, backend):
    """The head step is HydraStep captured by torch.export and lowered by the compile's backend (packed oneDNN
    linears on eager, an ONNX Runtime session, an inductor compilation), numerically the heads' own step, and
    decoding with it stays greedy-identical with drafts accepted."""
    from torch import fx

    from speccomp.backends.inductor import InductorStep
    from speccomp.backends.onnx_export import OrtStep
    from speccomp.drafters.hydra import save_hydra

    heads = random_hydra(model, vocab=torch.arange(3, 80))
    save_hydra(heads, tmp_path / "h")
    fast = speccomp.compile(model, drafter="hydra", drafter_options={"heads": str(tmp_path / "h")}, tree="dynamic:8:3",
                            backend=backend)
    step = fast.drafter.step
    assert isinstance(step, {"eager": fx.GraphModule, "onnxruntime": OrtStep, "inductor": InductorStep}[backend])
    if backend == "eager":
        targets = {str(n.target) for n in step.graph.nodes if n.op == "call_function"}
        assert "mkldnn._linear_pointwise.default" in targets and "aten.topk.default" in targets
    if backend == "onnxruntime":  # two sessions: the head step on one thread, the target's pool spinning beside it
        from test_engine import pool

        assert [pool(s.session) for s in (fast.step, step)] == [("spins", torch.get_num_threads()), ("sleeps", 1)]
    loaded = fast.drafter.heads  # the checkpoint as loaded (float16 on disk)
    s, tok = torch.randn(3, 32), torch.tensor([4, 9, 30])
    with torch.no_grad():
        z, logp, ids = step(torch.tensor(1), s, tok)
        ref = loaded.step(1, s, tok)
    torch.testing.assert_close(z, ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(ids[:, 0], loaded.draft_vocab[loaded.logits(ref).argmax(-1)])
    steps = tokens = 0
    for ids in prompts(2, seed=5):
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                              eos_token_id=2, pad_token_id=2)
        assert torch.equal(fast.generate(ids, max_new_tokens=24, eos_token_id=2), want)
        steps, tokens = steps + fast.last_stats["steps"], tokens + fast.last_stats["new_tokens"]
    assert steps < tokens


def test_hydra_drafts_follow_the_previous_token(model):
    """The same hidden state with another root token gives other drafts: heads read the token."""
    from speccomp.drafters.head_drafters import HydraDrafter
    from speccomp.runtime.decode import KVCache, DraftContext
    from speccomp.runtime.tree import Tree

    heads = random_hydra(model, k=2)
    drafter = HydraDrafter(heads, Tree.from_choices([[0], [0, 0]]))
    drafter.take_states((torch.randn(32, generator=torch.Generator().manual_seed(0)),))  # not the global RNG: the
    # tests before this one in the process (training seeds it) decided which state it drew
    cache = KVCache(speccomp.compile(model).kv, 8)
    a = drafter.propose(DraftContext([5, 6, 7], cache, 4, 8)).tokens
    s = heads.step(0, drafter.h[None], torch.tensor([7]))
    assert int(a[1]) == int(heads.draft_vocab[heads.logits(s).argmax()])  # head 0 on (h, root)
    firsts = {int(drafter.propose(DraftContext([5, 6, root], cache, 4, 8)).tokens[1]) for root in range(3, 60)}
    assert len(firsts) > 1  # the root token changes the drafts (a Medusa head would ignore it)


def test_hydra_round_trip_and_bad_files(model, tmp_path):
    from safetensors.torch import load_file

    from speccomp.drafters.hydra import load_hydra, save_hydra

    heads = random_hydra(model, vocab=torch.tensor([2, 5, 7, 11]))
    save_hydra(heads, tmp_path / "a")
    back = load_hydra(tmp_path / "a", model)
    assert torch.equal(back.draft_vocab, heads.draft_vocab)
    for (n1, x), (n2, y) in zip(heads.state_dict().items(), back.state_dict().items()):
        assert n1 == n2 and torch.equal(x.half().float(), y)  # stored as float16
    save_hydra(back, tmp_path / "b")  # a loaded file saves back bit for bit
    fa, fb = load_file(str(tmp_path / "a" / "hydra_heads.safetensors")), load_file(str(tmp_path / "b" / "hydra_heads.safetensors"))
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["head_type"] == "hydra" and cfg["hydra_num_heads"] == 3 and cfg["draft_vocab_size"] == 4

    other = tiny_llama(hidden_size=48, num_attention_heads=4, num_key_value_heads=2)
    save_hydra(random_hydra(other), tmp_path / "wrong")
    with pytest.raises(HeadsError, match="hidden size 48"):
        load_hydra(tmp_path / "wrong", model)
    small_vocab = tiny_llama(vocab_size=50, tie_word_embeddings=True)  # same hidden size, other vocabulary
    with pytest.raises(HeadsError, match="vocabulary of 96"):
        load_hydra(tmp_path / "a", small_vocab)
    (tmp_path / "a" / "hydra_heads.safetensors").write_bytes(b"garbage")
    with pytest.raises(HeadsError, match="corrupt"):
        load_hydra(tmp_path / "a", model)
    with pytest.raises(HeadsError, match="hydra"):
        speccomp.compile(model, drafter="hydra", drafter_options={"heads": str(tmp_path / "nothing")})


@pytest.mark.parametrize("draft_vocab, soft_labels", [(64, 0), (40, 8)])
def test_hydra_training_learns(model, tmp_path, draft_vocab, soft_labels):
    """Also with soft labels over a draft vocabulary smaller than the model's (40 of 96 tokens): they are mapped
    into it, tokens outside getting probability 0."""
    from speccomp.drafters.hydra import HydraHeads

    train = prompts(8, seed=1)
    heads = train_heads(model, train, out=tmp_path / "h", kind="hydra", num_heads=2, max_new_tokens=24, epochs=6,
                        lr=3e-2, batch_size=32, draft_vocab=draft_vocab, soft_labels=soft_labels, progress=False)
    assert isinstance(heads, HydraHeads) and len(heads.draft_vocab) <= draft_vocab < 96
    seqs, _ = distilled_text(tmp_path / "h")
    from speccomp.drafters.hydra import new_hydra

    trained = head_accuracy(heads, model, seqs)
    untrained = head_accuracy(new_hydra(model, heads.draft_vocab, 2), model, seqs)
    assert all(t > u + 0.1 for t, u in zip(trained, untrained)), (trained, untrained)
    fast = speccomp.compile(model, drafter="hydra", drafter_options={"heads": str(tmp_path / "h")})
    ids = seqs[0][:10]
    ref = model.generate(ids[None], attention_mask=torch.ones(1, 10, dtype=torch.long), max_new_tokens=20, do_sample=False,
                         eos_token_id=2, pad_token_id=2)
    assert torch.equal(fast.generate(ids, max_new_tokens=20, eos_token_id=2), ref)
    assert fast.last_stats["tau"] > 1.3  # trained heads on their own training text are accepted


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_soft_labels_teach_the_models_distribution(model, tmp_path, kind):
    """Teacher distillation: heads trained also on the model's top-8 probabilities match that distribution
    better than heads trained on its argmax alone (same data, seed and steps), and still decode losslessly."""
    from speccomp.tuning.train_heads import _examples, _hidden_states, soft_cross_entropy

    train = prompts(8, seed=1)
    kw = dict(kind=kind, num_heads=2, max_new_tokens=24, epochs=4, lr=3e-2, batch_size=32, progress=False)
    hard = train_heads(model, train, out=tmp_path / "hard", **kw)
    # draft_vocab left unset: 8192 tokens, or (here) the whole vocabulary of 96 when it is smaller
    assert kind == "medusa" or len(hard.draft_vocab) == 96
    soft = train_heads(model, train, out=tmp_path / "soft", soft_labels=8, **kw)
    seqs, starts = distilled_text(tmp_path / "soft")
    assert all(torch.equal(a, b) for a, b in zip(seqs, distilled_text(tmp_path / "hard")[0]))  # the same text
    h, inputs, _, (p, ids) = _examples(seqs, _hidden_states(model, seqs, progress=False, soft_k=8), 2, starts)

    def teacher_ce(heads):  # cross-entropy of the heads' distribution to the model's top-8, over all positions
        with torch.no_grad():
            logits = heads(h, inputs) if kind == "hydra" else heads(h)  # draft vocab == full vocab (96) here
            return float(soft_cross_entropy(logits, p, ids).mean())

    assert teacher_ce(soft) < teacher_ce(hard) - 0.05, (teacher_ce(soft), teacher_ce(hard))
    fast = speccomp.compile(model, drafter=kind, drafter_options={"heads": str(tmp_path / "soft")}, tree=[[0], [1], [0, 0]])
    ids0 = seqs[0][:10]
    ref = model.generate(ids0[None], attention_mask=torch.ones(1, 10, dtype=torch.long), max_new_tokens=20,
                         do_sample=False, eos_token_id=2, pad_token_id=2)
    assert torch.equal(fast.generate(ids0, max_new_tokens=20, eos_token_id=2), ref)


def test_typical_acceptance_is_opt_in_and_labelled_lossy(model, tmp_path):
    from speccomp.runtime.tree import Tree, typical_accept_lossy

    tree = Tree.from_choices([[0], [1], [0, 0]])
    probs = torch.tensor([[0.1, 0.6, 0.3, 0.0], [0.05, 0.05, 0.1, 0.8], [0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25]])
    # root 0; node 1 = token 1 (p 0.6: typical), node 2 = token 3 (p 0: not), node 3 = token 3 under node 1 (p 0.8)
    path, bonus = typical_accept_lossy(tree, torch.tensor([0, 1, 3, 3]), probs, generator=torch.Generator().manual_seed(0))
    assert path == [0, 1, 3]
    # the bonus is drawn from the last accepted node's row (node 3: uniform), not the root's (no token 3) or node 1's
    # (token 3 at 0.8): over 40 seeds each of the 4 tokens comes at least 4 times
    bonuses = [typical_accept_lossy(tree, torch.tensor([0, 1, 3, 3]), probs, generator=torch.Generator().manual_seed(s))[1]
               for s in range(40)]
    assert min(bonuses.count(t) for t in range(4)) >= 4, bonuses
    path, bonus = typical_accept_lossy(tree, torch.tensor([0, 3, 3, 0]), probs)  # token 3 has p = 0 at the root
    assert path == [0] and bonus in (0, 1, 2)
    save_medusa(random_heads(model), tmp_path / "h")
    fast = speccomp.compile(model, drafter="medusa", drafter_options={"heads": str(tmp_path / "h")}, tree=[[0], [1], [0, 0]])
    ids = prompts(1)[0]
    with pytest.raises(ValueError, match="greedy"):
        fast.generate(ids, max_new_tokens=5, acceptance="typical-lossy")
    with pytest.raises(ValueError, match="acceptance"):
        fast.generate(ids, max_new_tokens=5, do_sample=True, acceptance="typical")
    fast.generate(ids, max_new_tokens=8, do_sample=True, seed=0, acceptance="typical-lossy")
    assert fast.last_stats["lossless"] is False and fast.last_stats["acceptance"] == "typical-lossy"
    fast.generate(ids, max_new_tokens=8, do_sample=True, seed=0)
    assert fast.last_stats["lossless"] is True


@pytest.mark.parametrize("kind", ["medusa", "hydra", "eagle"])
def test_heads_load_onto_the_models_device_and_their_steps_are_captured_there(kind, tmp_path):
    """Heads are read on the CPU and run where the model is (gpu_check.py ran them on an H200 once they moved): every
    weight and index of the heads and of their step graph, and the step's capture example, on the model's device.
    The meta device stands in for a GPU (nothing can run there, so a tensor left on the CPU shows)."""
    from test_eagle import random_eagle

    from speccomp.drafters.eagle import EagleStep, load_eagle, save_eagle
    from speccomp.drafters.hydra import HydraStep, load_hydra, save_hydra

    model = tiny_llama()
    save, load, step = {"medusa": (lambda d: save_medusa(new_heads(model, 2), d), load_medusa, None),
                        "hydra": (lambda d: save_hydra(random_hydra(model, 2), d), load_hydra, HydraStep),
                        "eagle": (lambda d: save_eagle(random_eagle(model), d), load_eagle, EagleStep)}[kind]
    save(tmp_path)
    heads = load(tmp_path, model.to("meta"))
    tensors = [*heads.parameters(), *heads.buffers(), heads.lm_head,
               *([] if kind == "medusa" else [heads.embed, heads.draft_lm, heads.draft_vocab])]
    if step is not None:
        graph = step(heads)
        tensors += [*graph.buffers(), *graph.graph_spec().example]
    assert tensors and {t.device.type for t in tensors} == {"meta"}


@pytest.mark.parametrize("train", ["train_heads", "train_draft"])
def test_training_with_a_model_off_the_cpu_is_refused_before_any_work(train, tmp_path):
    """Training builds its replies, hidden states and batches on the CPU: a model elsewhere (meta standing in for a
    GPU) is refused by name before anything is generated or written, with the fix."""
    from speccomp.errors import OptionError

    with pytest.raises(OptionError, match=rf"model='a model on meta': {train} trains on the CPU; pass model.cpu\(\)"):
        getattr(speccomp, train)(tiny_llama().to("meta"), [torch.arange(3, 9)], out=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_head_step_runs_on_the_drafters_device_with_numpy_in_and_out(tmp_path):
    """run_step (Hydra's and EAGLE's steps, numpy for the shared tree growth) moves every input to the device the
    step's weights are on and hands numpy back; lower_step records that device. meta stands in for a GPU: the fake
    step records where its inputs are and answers on the host."""
    import numpy as np

    from speccomp.drafters.head_drafters import run_step

    seen = []

    def step(*inputs):
        seen.extend(t.device.type for t in inputs)
        return torch.ones(2, 3), torch.zeros(2, dtype=torch.long)

    out = run_step(step, torch.device("meta"), 1, np.zeros((2, 4), np.float32), np.arange(2))
    assert seen == ["meta"] * 3 and [type(o) for o in out] == [np.ndarray] * 2
    from speccomp.drafters.hydra import save_hydra

    model = tiny_llama()
    save_hydra(random_hydra(model, 2), tmp_path)
    hydra = speccomp.compile(model, drafter="hydra", tree="dynamic:6:2", drafter_options={"heads": str(tmp_path)}).drafter
    assert hydra.device == torch.device("cpu") == hydra.module.draft_lm.device


@pytest.mark.parametrize("kind", ["medusa", "hydra", "eagle"])
def test_heads_draft_for_a_bfloat16_model(model, tmp_path, kind):
    """Heads load in float32; a bfloat16 model's states met float32 weights. Medusa (inside the target graph) now
    runs in the model's dtype; Hydra and EAGLE in float32, as their host-side states and EAGLE's cache are held."""
    import copy

    from speccomp.drafters.eagle import new_eagle, save_eagle
    from speccomp.drafters.hydra import new_hydra, save_hydra

    d = tmp_path / kind
    {"medusa": lambda: save_medusa(random_heads(model), d),
     "hydra": lambda: save_hydra(new_hydra(model, torch.arange(96)), d),
     "eagle": lambda: save_eagle(new_eagle(model, torch.arange(96)), d)}[kind]()
    half = copy.deepcopy(model).to(torch.bfloat16)
    fast = speccomp.compile(half, drafter=kind, drafter_options={"heads": str(d)}, tree=[[0], [1], [0, 0]])
    ids = prompts(1, seed=22)[0]
    ref = speccomp.compile(half).generate(ids, max_new_tokens=10)
    with torch.no_grad():  # bfloat16 logits of a tree and of one token may differ in the last bit: compare where
        top = half(ref).logits[0, 9:-1].float().topk(2, -1).values  # no such difference can flip the argmax
    assert float((top[:, 0] - top[:, 1]).min()) > 0.1
    assert torch.equal(fast.generate(ids, max_new_tokens=10), ref)


def test_training_never_overwrites_heads_it_did_not_write(model, tmp_path):
    """train_heads into a folder holding heads no run there wrote (downloaded, saved by hand; here Medusa heads
    under a Hydra run) used to replace them; a damaged training state names itself and the fix."""
    kw = dict(num_heads=2, max_new_tokens=8, epochs=1, batch_size=32, progress=False)
    save_medusa(random_heads(model), tmp_path / "mine")
    before = {f.name: f.read_bytes() for f in (tmp_path / "mine").iterdir()}
    for kind in ("hydra", "medusa"):
        with pytest.raises(speccomp.OptionError, match=r"^out=.*no training run started.*choose a new or empty dir"):
            train_heads(model, prompts(2), out=tmp_path / "mine", kind=kind, **kw)
    assert {f.name: f.read_bytes() for f in (tmp_path / "mine").iterdir()} == before
    (tmp_path / "proj").mkdir()  # a project folder with a weights file of the heads' name and no config.json: was
    (tmp_path / "proj" / "medusa_lm_head.safetensors").write_bytes(b"mine")  # replaced by the run's heads
    with pytest.raises(speccomp.OptionError, match=r"^out=.*non-empty directory no training run started"):
        train_heads(model, prompts(2), out=tmp_path / "proj", **kw)
    assert [f.name for f in (tmp_path / "proj").iterdir()] == ["medusa_lm_head.safetensors"]
    assert (tmp_path / "proj" / "medusa_lm_head.safetensors").read_bytes() == b"mine"
    train_heads(model, prompts(2), out=tmp_path / "ours", **kw)
    train_heads(model, prompts(2), out=tmp_path / "ours", **kw)  # a run's own folder: finished, handed back
    (tmp_path / "ours" / "_train" / "progress.json").write_text("")  # an interrupted write (before: no such thing)
    with pytest.raises(speccomp.OptionError, match=r"unreadable training state .*progress.json.*delete"):
        train_heads(model, prompts(2), out=tmp_path / "ours", **kw)
    assert not list((tmp_path / "ours" / "_train").glob(".*.tmp"))  # atomic writes leave no temporaries


@pytest.mark.parametrize("kind", ["medusa", "hydra", "eagle"])
def test_heads_of_another_model_of_the_same_sizes_load_with_a_warning(model, tmp_path, kind):
    """Heads name the model they were made for (config.json base_fingerprint / base_dtype). Heads of another model
    with the same sizes used to load in silence (exact, but drafts that miss): now a warning names both fingerprints.
    Their own model, the same model cast to bfloat16 and heads without the fields load quietly; a loaded file saves
    its fields back."""
    import copy
    import warnings

    from test_eagle import random_eagle

    from speccomp.drafters.eagle import load_eagle, save_eagle
    from speccomp.drafters.hydra import load_hydra, save_hydra
    from speccomp.models import fingerprint

    save, load, make = {"medusa": (save_medusa, load_medusa, lambda m: random_heads(m)),
                        "hydra": (save_hydra, load_hydra, lambda m: random_hydra(m, 2)),
                        "eagle": (save_eagle, load_eagle, lambda m: random_eagle(m))}[kind]
    save(make(model), tmp_path / "h")
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    assert config["base_fingerprint"] == fingerprint(model) and config["base_dtype"] == "float32"
    other = copy.deepcopy(model)  # the same sizes, other weights (a fine-tuned model, say)
    with torch.no_grad():
        other.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    assert fingerprint(other) != fingerprint(model)
    with pytest.warns(UserWarning, match=rf"head in {tmp_path / 'h'} was trained for another model \(fingerprint "
                                         rf"{fingerprint(model)}; this model's is {fingerprint(other)}\)"):
        load(tmp_path / "h", other)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = load(tmp_path / "h", model)
        load(tmp_path / "h", copy.deepcopy(model).to(torch.bfloat16))
    save(back, tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["base_fingerprint"] == fingerprint(model)
    del config["base_fingerprint"]
    (tmp_path / "h" / "config.json").write_text(json.dumps(config))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load(tmp_path / "h", other)


@pytest.mark.parametrize("kind", ["hydra", "eagle"])
def test_training_leaves_the_callers_random_state_alone(model, tmp_path, kind):
    """The heads' initial weights come from `seed` without reseeding the caller's global RNG (it used to be left at
    manual_seed(seed), so what the caller drew next depended on having trained); the same seed trains the same heads."""
    kw = dict(kind=kind, num_heads=2, max_new_tokens=6, epochs=1, batch_size=32, progress=False, seed=3)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    first = train_heads(model, prompts(2), out=tmp_path / "a", **kw)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(99)
    again = train_heads(model, prompts(2), out=tmp_path / "b", **kw)
    assert all(torch.equal(x, y) for x, y in zip(first.state_dict().values(), again.state_dict().values()))
