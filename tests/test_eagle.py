"""EAGLE draft head: the training view equals what the drafter computes, lossless decoding, training, checkpoints."""
import importlib
import json

import pytest
import torch

import speccomp
from speccomp.drafters.grow import Grown
from speccomp.drafters.eagle_drafter import EagleDrafter
from speccomp.drafters.eagle import EagleHead, load_eagle, new_eagle, save_eagle
from speccomp.drafters.medusa import HeadsError
from speccomp.runtime.decode import DraftContext
from speccomp.tuning.train_heads import distilled_text, eagle_accuracy, train_heads
from speccomp.runtime.tree import Tree
from tiny_models import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(num_hidden_layers=3, initializer_range=0.2, tie_word_embeddings=True)


def random_eagle(model, vocab=None, seed=0, scale=0.1):
    head = new_eagle(model, torch.arange(96) if vocab is None else vocab)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return head.eval()


@pytest.mark.parametrize("prompt_known", [True, False])
def test_unrolled_training_view_is_the_drafters_computation(model, prompt_known):
    """Training unrolls the head on its own guesses for every anchor at once (custom attention over the true
    entries plus the anchor's earlier steps). That must be exactly what the drafter computes at run time with
    its KV cache and tree mask, also for a node under a second branch (whose sibling's entry it must not see)."""
    head = random_eagle(model)
    t, p = 12, 5
    g = torch.Generator().manual_seed(1)
    f, x = torch.randn(1, t, 32, generator=g), torch.randint(3, 96, (1, t), generator=g)
    with torch.no_grad():
        outs = head.unrolled(f, x, torch.ones(1, t, dtype=torch.bool), 3)
        drafter = EagleDrafter(head, Tree.from_choices([[0], [1]]))
        # entries (f_q, x_{q+1}) for q <= p; the root is x_{p+1}. Knowing the prompt x_0..x_p, the drafter runs
        # the entries q < p at take_states (with the prefill), else all of them in the first propose
        drafter.begin(x[0, : p + 1].tolist() if prompt_known else [])
        drafter.take_states((f[0, : p + 1],))
        assert drafter.cache.length == (p if prompt_known else 0)
        expand = drafter.cache.expander(x[0, : p + 2].tolist())
        # candidates: 0 root, 1 = a decoy sibling, 2 = x_{p+2} (true path, second branch), 3 = x_{p+3} under it
        token = [int(x[0, p + 1]), int(x[0, p + 2]) + 1, int(x[0, p + 2]), int(x[0, p + 3])]
        grown = Grown(parent=[-1, 0, 0, 2], token=token, depth=[0, 1, 1, 2])
        expand(1, [1, 2], grown, 2)
        expand(2, [3], grown, 2)
    out = {c: torch.from_numpy(o) for c, o in drafter.cache.out.items()}
    torch.testing.assert_close(out[0][0], outs[0][0, p], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[2][0], outs[1][0, p], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[3][0], outs[2][0, p], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out[1][0], outs[1][0, p])  # the decoy is another token: another guess


@pytest.mark.parametrize("tree", [[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]], "dynamic:8:3", 5])
def test_eagle_greedy_identical(model, tmp_path, tree):
    save_eagle(random_eagle(model, vocab=torch.arange(3, 80)), tmp_path / "h")  # a draft vocabulary subset
    fast = speccomp.compile(model, drafter="eagle", drafter_options={"heads": str(tmp_path / "h")}, tree=tree)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        ids = torch.randint(3, 96, (1, 10), generator=g)
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False,
                             eos_token_id=2, pad_token_id=2)
        assert torch.equal(fast.generate(ids, max_new_tokens=30, eos_token_id=2), ref)


@pytest.mark.parametrize("backend", ["eager", "onnxruntime", "inductor"])
def test_eagle_layer_step_is_a_lowered_graph(model, tmp_path, backend):
    """The layer step is EagleStep (its cache in and out) captured by torch.export and lowered by the compile's
    backend; it computes the head's own entries/attention/finish, and decoding with it is greedy-identical with
    drafts accepted."""
    from torch import fx

    from speccomp.backends.inductor import InductorStep
    from speccomp.backends.onnx_export import OrtStep

    save_eagle(random_eagle(model, vocab=torch.arange(3, 80)), tmp_path / "h")
    fast = speccomp.compile(model, drafter="eagle", drafter_options={"heads": str(tmp_path / "h")}, tree="dynamic:8:3",
                            backend=backend)
    step, head = fast.drafter.step, fast.drafter.head
    assert isinstance(step, {"eager": fx.GraphModule, "onnxruntime": OrtStep, "inductor": InductorStep}[backend])
    if backend == "eager":
        targets = {str(n.target) for n in step.graph.nodes if n.op == "call_function"}
        assert "mkldnn._linear_pointwise.default" in targets and "aten.scaled_dot_product_attention.default" in targets
    g = torch.Generator().manual_seed(2)
    a, d = head.num_heads, head.head_dim
    feats, tokens, past_k, past_v = torch.randn(2, 32, generator=g), torch.tensor([5, 9]), torch.randn(a, 3, d), torch.randn(a, 3, d)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 0, 1, 0, 1]], dtype=torch.bool)
    with torch.no_grad():
        out, k, v, logp, ids = step(feats, tokens, torch.tensor([3, 4]), past_k, past_v, mask)
        u, q, k_ref, v_ref = head.entries(feats, tokens, torch.tensor([3, 4]))
        keys, values = torch.cat([past_k, k_ref.transpose(0, 1)], 1), torch.cat([past_v, v_ref.transpose(0, 1)], 1)
        scores = (q.transpose(0, 1) @ keys.transpose(1, 2)) / d ** 0.5  # [A, 2, 5]
        attn = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ values
        ref = head.finish(u, attn.transpose(0, 1))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(k, k_ref.transpose(0, 1), rtol=1e-4, atol=1e-5)
    assert torch.equal(ids[:, 0], head.draft_vocab[head.logits(ref).argmax(-1)])
    steps = new = 0
    for seed, n in ((5, 10), (6, 1)):  # a 1-token prompt: the layer's cache starts empty, its mask is [1, 1]
        x = torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(seed))
        want = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False,
                              eos_token_id=2, pad_token_id=2)
        assert torch.equal(fast.generate(x, max_new_tokens=24, eos_token_id=2), want)
        steps, new = steps + fast.last_stats["steps"], new + fast.last_stats["new_tokens"]
    assert steps < new  # drafts were accepted


def test_eagle_past_the_sliding_window():
    """The target keeps its sliding window (the drafter only proposes tokens); text longer than the window."""
    from tiny_models import WINDOW, _mistral

    target = _mistral(0, tie_word_embeddings=True)
    assert 12 + 24 > 2 * WINDOW
    head = new_eagle(target, torch.arange(target.config.vocab_size))
    fast = speccomp.compile(target, drafter=EagleDrafter(head, Tree.from_choices([[0], [1], [0, 0]])))
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(2))
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    assert torch.equal(fast.generate(ids, max_new_tokens=24), ref)


def test_eagle_training_learns_resumes_and_is_seeded(model, tmp_path, monkeypatch):
    th = importlib.import_module("speccomp.tuning.train_heads")

    g = torch.Generator().manual_seed(1)
    train = [torch.randint(3, 96, (1, 10), generator=g) for _ in range(8)]
    epochs = 12
    kwargs = dict(kind="eagle", num_heads=3, max_new_tokens=24, epochs=epochs, lr=1e-2, batch_size=2, draft_vocab=64,
                  progress=False)
    calls = {"n": 0, "stop": None}
    real_loss = th._eagle_loss

    def counting_loss(*args, **kw):
        calls["n"] += 1
        if calls["stop"] and calls["n"] > calls["stop"]:
            raise KeyboardInterrupt  # the user stops the run in the middle of epoch 2
        return real_loss(*args, **kw)

    monkeypatch.setattr(th, "_eagle_loss", counting_loss)
    head = train_heads(model, train, out=tmp_path / "h", **kwargs)
    assert isinstance(head, EagleHead) and len(head.draft_vocab) <= 64
    per_epoch = calls["n"] // epochs
    calls.update(n=0, stop=per_epoch + 1)
    with pytest.raises(KeyboardInterrupt):
        train_heads(model, train, out=tmp_path / "h2", **kwargs)
    assert json.loads((tmp_path / "h2" / "_train" / "progress.json").read_text())["epoch"] == 1
    calls.update(n=0, stop=None)
    again = train_heads(model, train, out=tmp_path / "h2", **kwargs)  # resumes at epoch 2
    assert calls["n"] == (epochs - 1) * per_epoch
    for a, b in zip(head.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)  # seeded and resumable: the same head as the uninterrupted run

    seqs, starts = distilled_text(tmp_path / "h")
    trained = eagle_accuracy(head, model, seqs, starts, steps=3)
    untrained = eagle_accuracy(new_eagle(model, head.draft_vocab), model, seqs, starts, steps=3)
    # (the untrained head starts as the identity on the feature, so it already scores the token just read)
    assert trained[0] > untrained[0] + 0.05 and trained[1] > untrained[1] + 0.03, (trained, untrained)
    fast = speccomp.compile(model, drafter="eagle", drafter_options={"heads": str(tmp_path / "h")})
    taus = []
    for s in seqs[:4]:
        ids = s[:10]
        ref = model.generate(ids[None], attention_mask=torch.ones(1, 10, dtype=torch.long), max_new_tokens=20,
                             do_sample=False, eos_token_id=2, pad_token_id=2)
        assert torch.equal(fast.generate(ids, max_new_tokens=20, eos_token_id=2), ref)
        taus.append(fast.last_stats["tau"])
    assert sum(taus) / len(taus) > 1.2, taus  # a trained head on its own training text is accepted
    with pytest.raises(ValueError, match="soft_labels does not apply"):
        train_heads(model, train, out=tmp_path / "h3", **{**kwargs, "soft_labels": 4})


def test_no_eagle_head_error_says_how_to_train(model, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCOMP_CACHE", str(tmp_path))
    with pytest.raises(HeadsError, match="speccomp train-heads --kind eagle"):
        speccomp.compile(model, drafter="eagle")


def test_eagle_round_trip_and_bad_files(model, tmp_path):
    from safetensors.torch import load_file

    head = random_eagle(model, vocab=torch.tensor([2, 5, 7, 11]))
    save_eagle(head, tmp_path / "a")
    back = load_eagle(tmp_path / "a", model)
    assert torch.equal(back.draft_vocab, head.draft_vocab)
    for (n1, x), (n2, y) in zip(head.state_dict().items(), back.state_dict().items()):
        assert n1 == n2 and torch.equal(x.half().float(), y)  # stored as float16
    save_eagle(back, tmp_path / "b")  # a loaded file saves back bit for bit
    fa, fb = load_file(str(tmp_path / "a" / "eagle_head.safetensors")), load_file(str(tmp_path / "b" / "eagle_head.safetensors"))
    assert fa.keys() == fb.keys() and all(torch.equal(fa[k], fb[k]) for k in fa)
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    assert cfg["head_type"] == "eagle" and cfg["draft_vocab_size"] == 4 and cfg["hidden_size"] == 32

    other = tiny_llama(hidden_size=48, num_attention_heads=4, num_key_value_heads=2)
    save_eagle(new_eagle(other, torch.arange(10)), tmp_path / "wrong")
    with pytest.raises(HeadsError, match="hidden size 48"):
        load_eagle(tmp_path / "wrong", model)
    small_vocab = tiny_llama(vocab_size=50, tie_word_embeddings=True)  # same hidden size, other vocabulary
    with pytest.raises(HeadsError, match="vocabulary of 96"):
        load_eagle(tmp_path / "a", small_vocab)
    (tmp_path / "a" / "eagle_head.safetensors").write_bytes(b"garbage")
    with pytest.raises(HeadsError, match="corrupt"):
        load_eagle(tmp_path / "a", model)
    with pytest.raises(HeadsError, match="not an EAGLE head directory"):
        speccomp.compile(model, drafter="eagle", drafter_options={"heads": str(tmp_path / "nothing")})
    with pytest.raises(ValueError, match="unknown eagle options"):
        speccomp.compile(model, drafter="eagle", drafter_options={"heads": str(tmp_path / "b"), "depth": 3})


def test_dynamic_trees_stop_at_the_trained_depth(model, tmp_path):
    from speccomp.drafters.grow import MAX_DYNAMIC_DEPTH
    from speccomp.runtime.tree import DynamicTreeSpec

    head = random_eagle(model)
    head.train_steps = 2
    save_eagle(head, tmp_path / "h")
    back = load_eagle(tmp_path / "h", model)
    assert back.train_steps == 2 and json.loads((tmp_path / "h" / "config.json").read_text())["train_steps"] == 2
    back.draft_lm = back.draft_lm * 100  # confident drafts: growth never stops for low probability

    def depth(steps):
        back.train_steps = steps
        drafter = EagleDrafter(back, DynamicTreeSpec(16, 1))  # top-1: a chain as deep as allowed
        g = torch.Generator().manual_seed(3)
        drafter.begin([])
        drafter.take_states((torch.randn(6, 32, generator=g),))
        return drafter.propose(DraftContext(list(range(3, 10)), None, 8, 32)).tree.max_depth

    assert depth(2) == 2 and depth(None) == MAX_DYNAMIC_DEPTH


def test_autotune_can_retree_the_eagle_drafter(model):
    from speccomp.tuning.autotune import retree
    from speccomp.runtime.tree import DynamicTreeSpec

    drafter = EagleDrafter(random_eagle(model), Tree.from_choices([[0]]))
    assert drafter.trees == ("static", "dynamic") and "path_states" in drafter.reads
    chain = retree(drafter, Tree.from_choices([[0], [0, 0]]))
    grown = retree(drafter, DynamicTreeSpec(6, 2))
    assert isinstance(chain, EagleDrafter) and chain.head is drafter.head and chain.tree.size == 3
    assert isinstance(grown.tree, DynamicTreeSpec) and grown.head is drafter.head
    with pytest.raises(TypeError, match="Tree or a DynamicTreeSpec"):
        EagleDrafter(drafter.head, [[0]])


@pytest.mark.parametrize("argv, match", [
    (["--soft-labels", "4"], "--soft-labels does not apply"), (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--layers", "2"], "one decoder layer"),
])
def test_cli_refuses_eagle_options_before_loading_the_model(capsys, monkeypatch, argv, match):
    import speccomp.cli as cli

    def no_load(args):
        raise AssertionError("the model was loaded before the options were checked")

    monkeypatch.setattr(cli, "_load", no_load)
    assert cli.main(["train-heads", "--kind", "eagle", *argv, "--prompts", "x.jsonl"]) == 2
    assert match in capsys.readouterr().err
