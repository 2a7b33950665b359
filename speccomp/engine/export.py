"""Write a compiled model as an engine directory that speccomp/engine/runtime.py runs without torch.

    fast = speccomp.compile(model, drafter="token_recycling", backend="onnxruntime")
    fast.export("engine/", tokenizer=tokenizer)        # target.onnx + manifest.json + tokenizer.json
    engine = speccomp.load("engine/")                  # elsewhere: onnxruntime + numpy only

The target graph exported is the one the compiled model verifies with (TreeAttention applied; for plain decoding the
pass is applied to a copy here; with Medusa heads, MedusaHeads too, so the graph also returns every token's head
states). A Medusa engine adds medusa.onnx, the heads' projection to the vocabulary with a top-k (tied heads: a copy of
the LM head, so the engine grows by its size); a Hydra engine hydra.onnx, one head step for every depth (HydraStep);
an EAGLE engine eagle.onnx, the layer step with its cache in and out (EagleStep); a self-drafter its draft graph.
Each graph the onnxruntime backend already exported is copied, any other exported here. A merged drafter
("hydra+token_recycling") writes one manifest entry per drafter under drafter.drafters.

What export may touch (`check_destination`): the destination must be a new or empty directory, or, with
overwrite=True, an engine whose manifest says format "speccomp-engine" and that holds nothing but the files that
manifest names, each as export wrote it (the SHA-256 the manifest recorded: a tokenizer edited by hand is kept). It
is never ".", the home directory, the filesystem root or any ancestor of the working directory.
The new engine is written in a temporary directory beside the destination and swapped in by renames (`swap_in`: the
old engine moves aside and is checked again there, the new one moves in, the old one is deleted last), so export
deletes nothing it did not write and an interrupted export never leaves half an engine at the destination. A crash
between the two renames leaves the old engine in `.NAME-old-XXXX/previous` beside the destination.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import onnx

from speccomp.drafters.grow import MAX_DYNAMIC_DEPTH
from speccomp.engine.runtime import (ENGINE_DRAFTERS, FORMAT, FORMAT_VERSION, GRAPH_FILES, MANIFEST, MEDUSA_FILE,
                                     SELF_DRAFTERS, TOP_IDS_OUTPUT, TOP_ROWS_INPUT, EngineError, check_makeable,
                                     sha256, tokenizer_files)
from speccomp.models import is_broad_directory, set_default_mode

# a draft model with a tokenizer of its own: both tokenizers beside draft_model.onnx (engine/runtime.py _text_bridge)
DRAFT_TOKENIZERS = {"target": "draft_model.target_tokenizer.json", "draft": "draft_model.tokenizer.json"}


def drafter_spec(drafter) -> dict:
    """The manifest's `drafter` entry: the name and every option the torch-free loop needs (merges: one entry per
    drafter under `drafters`); a drafter with a graph names its file (GRAPH_FILES)."""
    if drafter is None:
        return {"name": None, "options": {}}
    name = drafter.name
    if "+" in name and hasattr(drafter, "drafters"):
        return {"name": name, "options": {}, "drafters": [drafter_spec(d) for d in drafter.drafters]}
    if name in ENGINE_DRAFTERS and type(drafter).__module__.split(".")[0] != "speccomp":  # a user's, named like one
        raise EngineError(f"drafter {name!r} is a user-written {type(drafter).__name__} named like speccomp's own "
                          f"{name} drafter: an engine would draft with speccomp's instead; user-written drafters "
                          "cannot be exported (the torch-free runtime cannot run their Python)")
    if name not in ENGINE_DRAFTERS:
        raise EngineError(f"drafter {name!r} cannot be exported as an engine yet: the torch-free runtime drafts with "
                          f"{[d for d in ENGINE_DRAFTERS if d]} (alone or merged, e.g. 'hydra+token_recycling') or "
                          "decodes plainly; compile with one of those (or drafter=None)")
    tree = drafter.tree
    shape = {} if tree is None else dict(parents=list(tree.parents), ranks=list(tree.ranks)) if hasattr(tree, "ranks") \
        else dict(budget=tree.budget, top_k=tree.top_k)
    if name == "medusa":  # the heads become medusa.onnx; states_output is filled in once the target is exported
        options = dict(shape, num_heads=drafter.max_tree_depth, top=max(shape["ranks"]) + 1)
    elif name == "hydra":  # one head step becomes hydra.onnx (with its top-k); the tree grows in the engine
        heads = drafter.max_tree_depth
        options = dict(num_heads=heads, top=drafter.max_siblings, tree=shape, max_depth=min(MAX_DYNAMIC_DEPTH, heads))
    elif name == "eagle":  # the layer step becomes eagle.onnx; its cache and the tree's growth are the engine's
        options = dict(num_heads=drafter.head.num_heads, head_dim=drafter.head.head_dim, top=drafter.max_siblings,
                       tree=shape, max_depth=drafter.max_depth)
    elif name == "draft_model":  # the draft LM's graph becomes draft_model.onnx; its cache is the engine's
        own = drafter.options.get("tokenizers") == "own"  # a draft with a tokenizer of its own: both written too
        drafter = drafter.inner if own else drafter
        kv, dtype = drafter.kv, str(drafter.kv.dtype).removeprefix("torch.")
        if dtype not in ("float32", "float16"):
            raise EngineError(f"the draft model's KV cache is {dtype}, which the engine's numpy runtime cannot hold; "
                              "compile the draft model in float32 (or float16) to export it")
        depth = int(tree.max_depth) if hasattr(tree, "ranks") else MAX_DYNAMIC_DEPTH  # static trees: all of it
        options = dict(kv_layers=list(range(kv.num_layers)), tree=shape, max_depth=depth,
                       kv={"num_layers": kv.num_layers, "num_kv_heads": kv.num_kv_heads, "head_dim": kv.head_dim,
                           "dtype": dtype},
                       max_nodes=drafter.max_nodes, max_positions=drafter.max_positions)
        if own:
            options["tokenizers"] = dict(DRAFT_TOKENIZERS)
    elif name in SELF_DRAFTERS:  # the draft graph becomes NAME.onnx
        if drafter.graph is None and not hasattr(drafter.step, "path"):
            raise EngineError(f"this {name} drafter was built without its graph; compile it with speccomp.compile")
        # compressed_kv (kv_mode="draft"): its layers are kv_layers; the policy spec is parsed again at load
        options = {"kv_cache": drafter.policy.spec} if name == "compressed_kv" else dict(drafter.options)
        if name == "compressed_kv" and (drafter.options or {}).get("weights") in ("int4", "int8"):
            options["weights"] = drafter.options["weights"]  # the graph file holds them (MatMulNBits)
        options.update(kv_layers=drafter.layer_index.tolist(), tree=shape, max_depth=MAX_DYNAMIC_DEPTH)
    else:  # ngram: its options; token_recycling: + tree
        return {"name": name, "options": dict(drafter.options, **shape)}
    # light: the compiled drafter's own verdict (Drafter.light_graphs), which the engine's sessions follow
    return {"name": name, "options": options, "graph": GRAPH_FILES[name], "light": bool(drafter.light_graphs)}


def _parts(spec: dict) -> list[dict]:
    """The single drafter entries of a manifest's drafter entry (a merge's parts, else itself)."""
    return spec.get("drafters") or [spec]


def _drafter_graphs(fast, spec: dict, target_outputs: list[str], out: Path) -> dict:
    """Write the graphs of the drafters that have one (GRAPH_FILES: medusa.onnx, hydra.onnx, eagle.onnx, the
    self-drafters'); their manifest entries."""
    graphs = {}
    objects = getattr(fast.drafter, "drafters", None) or [fast.drafter]
    for part, drafter in zip(_parts(spec), objects):
        if part["name"] == "medusa":
            if len(target_outputs) < 4:
                raise EngineError(f"the Medusa target graph should return (logits, new_kv, hidden, head states), got "
                                  f"{target_outputs}")
            part["options"]["states_output"] = target_outputs[3]
            file = _medusa_onnx(drafter, out / MEDUSA_FILE)
        elif part["name"] in ("hydra", "eagle"):
            file = _module_onnx(drafter, out / part["graph"])
        elif part["name"] in SELF_DRAFTERS or part["name"] == "draft_model":
            if "tokenizers" in part["options"]:  # CrossTokenizerDrafter: its bridge's two tokenizers
                for side, tokenizer in (("target", drafter.bridge.target), ("draft", drafter.bridge.draft)):
                    tokenizer.save(str(out / DRAFT_TOKENIZERS[side]))
                drafter = drafter.inner
            file = _copy_or_export(drafter.step, drafter.graph, out / part["graph"])
        else:
            continue
        graphs[part["name"]] = _graph_entry(file, onnx.load(str(file), load_external_data=False))
    return graphs


def check_tokenizer(tokenizer, vocab_size: int) -> None:
    """export(tokenizer=) must be a Hugging Face fast tokenizer whose ids the model can take (checked before the
    export's minutes of work)."""
    from speccomp.errors import OptionError, OptionTypeError

    if tokenizer is None:
        return
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        raise OptionTypeError("tokenizer", tokenizer, f"must be a Hugging Face *fast* tokenizer (with .backend_tokenizer), "
                              f"got {type(tokenizer).__name__}", "pass AutoTokenizer.from_pretrained(...) of this model")
    size = len(tokenizer)
    if size > vocab_size:
        raise OptionError("tokenizer", type(tokenizer).__name__, f"has {size} tokens but the model scores {vocab_size}: "
                          "it makes ids the model cannot take", "pass this model's own tokenizer")


def _tokenizer_entry(tokenizer, out: Path) -> dict | None:
    if tokenizer is None:
        return None
    tokenizer.backend_tokenizer.save(str(out / "tokenizer.json"))
    # what apply_chat_template hands the template beside the messages (bos_token, eos_token, sep_token, ...)
    special = getattr(tokenizer, "special_tokens_map", None)
    if not isinstance(special, dict):
        special = {k: getattr(tokenizer, k, None) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates ({"default": ..., "tool_use": ...}): the one chat uses
        template = template.get("default")
    return {"file": "tokenizer.json", "chat_template": template if isinstance(template, str) else None,
            "special_tokens": {k: v for k, v in special.items() if isinstance(v, str)}}


def _medusa_onnx(drafter, path: Path) -> Path:
    """medusa.onnx: head states [K, H] (one token's) -> each head's top token ids [K, top], best first."""
    import torch

    from speccomp.backends.drafter_graph import DrafterGraphSpec, export_module_onnx

    heads, top = drafter.heads, drafter.top

    class HeadsTopK(torch.nn.Module):
        def forward(self, medusa_states):  # [K, H]
            return heads.project(medusa_states).topk(top, dim=-1).indices  # [K, V] -> [K, top]

    example = (torch.zeros(heads.num_heads, heads.hidden),)
    return export_module_onnx(HeadsTopK(), DrafterGraphSpec("medusa", ["medusa_states"], ["top_ids"], example, None), path)


def _module_onnx(drafter, path: Path) -> Path:
    """A drafter's module graph (Hydra's head step, EAGLE's layer step): the ONNX file its onnxruntime lowering runs
    (copied), else exported now by the same function."""
    from speccomp.backends.drafter_graph import export_module_onnx
    from speccomp.backends.onnx_export import OrtStep

    if isinstance(drafter.step, OrtStep):
        return _copy_onnx(drafter.step.path, path)
    return export_module_onnx(drafter.module, drafter.module.graph_spec(), path)


def _copy_onnx(src: Path, path: Path) -> Path:
    """An ONNX file copied to `path`, with its external weights (NAME.data: beyond protobuf's 2 GB) if it has them:
    then the copy's graph names PATH.data (the source names its own file, which the backend removes at exit)."""
    data = src.with_name(src.name + ".data")
    if not data.exists():
        shutil.copyfile(src, path)
        return path
    import onnx

    from onnx.external_data_helper import _get_all_tensors  # what onnx's own save walks (no public name)

    proto = onnx.load(str(src), load_external_data=False)
    for tensor in _get_all_tensors(proto):
        for entry in tensor.external_data:
            if entry.key == "location" and entry.value == data.name:
                entry.value = path.name + ".data"
    onnx.save(proto, str(path))
    shutil.copyfile(data, path.with_name(path.name + ".data"))
    return path


def _target_onnx(fast, out: Path) -> Path:
    """target.onnx in `out`: copied from the onnxruntime backend, else exported from the graph."""
    from speccomp.backends.onnx_export import OrtStep
    from speccomp.frontend.graph import run_passes
    from speccomp.passes.tree_attention import TreeAttention

    path = out / "target.onnx"
    if isinstance(fast.step, OrtStep) and "tree_attention" in fast.graph.applied:
        return _copy_or_export(fast.step, None, path)
    sg = fast.graph
    if "tree_attention" not in sg.applied:  # plain decoding: the engine verifies with the same graph always
        sg = run_passes(sg.clone(), [TreeAttention()], dump_input=False)
    extra = [n for n in sg.applied if n not in ("tree_attention", "medusa_heads")]
    if extra:
        raise EngineError(f"the target graph carries passes {extra} the engine runtime cannot feed; export supports "
                          f"plain compilations and the drafters {[d for d in ENGINE_DRAFTERS if d]}")
    return _copy_or_export(None, sg, path)


def _copy_or_export(step, sg, path: Path) -> Path:
    """`path`: the ONNX file an onnxruntime backend's `step` already runs (copied), else `sg` exported."""
    from speccomp.backends.onnx_export import OrtStep, export_onnx
    from speccomp.backends.onnxruntime import export_args

    if isinstance(step, OrtStep):
        return _copy_onnx(step.path, path)
    args, dynamic = export_args(sg)
    return export_onnx(sg, path, example_args=args, dynamic_shapes=dynamic)


def _add_top_ids(path: Path, k: int):
    """Token Recycling observes every verified node's top-k tokens: a TopK on the logits inside the target graph
    (output TOP_IDS_OUTPUT [1, m, k]) instead of a numpy top-k over the vocabulary per node in the loop (numpy's
    argpartition took ~4% of a hydra+token_recycling engine's time; ONNX Runtime's TopK reads the logits once). It
    reads only the nodes the runtime names (input TOP_ROWS_INPUT [m]): not a prefill's, nor a batch row's whose
    drafter is switched off (runtime/budget.py), whose observe is skipped.

        before: ... -> logits          after: ... -> logits -> Gather(top_ids_rows, axis=1) -> TopK(k) -> top_ids
    """
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    proto = onnx.load(str(path), load_external_data=False)  # external weights stay where they are
    graph = proto.graph
    if graph.output[0].name != "logits":
        raise EngineError(f"{path.name}'s first output is {graph.output[0].name!r}, not 'logits'; cannot add the top-k")
    graph.initializer.append(numpy_helper.from_array(np.array([k], dtype=np.int64), "top_ids_k"))
    graph.input.append(helper.make_tensor_value_info(TOP_ROWS_INPUT, TensorProto.INT64, ["m"]))
    graph.node.append(helper.make_node("Gather", ["logits", TOP_ROWS_INPUT], ["top_ids_logits"], axis=1,
                                       name="top_ids_rows"))
    graph.node.append(helper.make_node("TopK", ["top_ids_logits", "top_ids_k"], ["top_ids_scores", TOP_IDS_OUTPUT],
                                       axis=-1, largest=1, sorted=1, name="top_ids"))
    graph.output.append(helper.make_tensor_value_info(TOP_IDS_OUTPUT, TensorProto.INT64, [1, "m", k]))
    onnx.save(proto, str(path))
    return proto  # what export reads next: the graph is not loaded twice (its weights are inline, ~540 MB)


def _graph_entry(path: Path, proto) -> dict:
    entry = {"file": path.name, "bytes": path.stat().st_size, "sha256": sha256(path),
             "inputs": [i.name for i in proto.graph.input], "outputs": [o.name for o in proto.graph.output]}
    data = path.with_name(path.name + ".data")  # external weights (graphs over 2 GB): verified like the graph
    if data.is_file():
        entry["data"] = {"bytes": data.stat().st_size, "sha256": sha256(data)}
    return entry


def engine_files(path: Path) -> set[str] | None:
    """The names of the files the engine at `path` consists of (its manifest's own list), or None when `path`
    holds no readable speccomp manifest (format field checked: a file named manifest.json proves nothing)."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return None
    names = {MANIFEST}
    for graph in (manifest.get("graphs") or {}).values():
        file = graph.get("file") if isinstance(graph, dict) else None
        if isinstance(file, str):  # and its weights file where the manifest records one (a user's is not ours)
            names |= {file, file + ".data"} if isinstance(graph.get("data"), dict) else {file}
    return names | set(tokenizer_files(manifest))  # the target's tokenizer, a draft model's own


def _edited_files(path: Path) -> list[str]:
    """The files of the engine at `path` whose SHA-256 differs from the one its manifest recorded at export: a
    tokenizer the user edited, a graph replaced by hand. They are no longer what export wrote."""
    manifest = json.loads((path / MANIFEST).read_text())  # engine_files read it already
    digests = dict(manifest["files"]) if isinstance(manifest.get("files"), dict) else {}  # the tokenizers'
    for graph in (manifest.get("graphs") or {}).values():
        if isinstance(graph, dict) and isinstance(graph.get("file"), str):
            digests[graph["file"]] = graph
            digests[graph["file"] + ".data"] = graph.get("data")
    return sorted(name for name, entry in digests.items() if isinstance(name, str) and isinstance(entry, dict)
                  and (path / name).is_file() and sha256(path / name) != entry.get("sha256"))


def check_destination(path, overwrite: bool) -> Path:
    """The absolute destination of an export, after refusing every place an export could destroy a user's files."""
    from speccomp.errors import OptionTypeError

    if not isinstance(path, (str, os.PathLike)):
        raise OptionTypeError("path", path, f"must be a directory path (str or os.PathLike), got {type(path).__name__}")
    if not isinstance(overwrite, bool):
        raise OptionTypeError("overwrite", overwrite, "must be True or False")
    path = Path(os.path.abspath(Path(path).expanduser()))
    if is_broad_directory(path):
        raise EngineError(f"refusing to export into {path}: it is the working directory, one of its parents, the home "
                          "directory or the filesystem root; give a new directory such as ./my-engine")
    if path.is_symlink():
        raise EngineError(f"{path} is a symbolic link; export to a real directory path")
    if path.exists() and not path.is_dir():
        raise EngineError(f"{path} exists and is not a directory; choose another path")
    check_makeable(path)
    if path.is_dir() and any(path.iterdir()):
        _check_replaceable(path, overwrite, path)
    return path


def _check_replaceable(where: Path, overwrite: bool, path: Path) -> None:
    """The non-empty directory `where` (the destination `path`, or where it was moved aside) may be replaced: it
    is an engine (its manifest's format says so), holds nothing its manifest does not name, and overwrite=True."""
    owned = engine_files(where)
    if owned is None:
        raise EngineError(f"{path} is a non-empty directory that is not a speccomp engine; refusing to replace it "
                          "(choose a new directory)")
    if not overwrite:
        raise EngineError(f"{path} already holds an engine; pass overwrite=True (CLI: --overwrite) to replace it")
    foreign = sorted(p.name for p in where.iterdir() if p.name not in owned)
    if foreign:
        raise EngineError(f"{path} holds an engine plus files it did not write {foreign[:5]}; refusing to replace "
                          "it (move those files out, or export elsewhere)")
    edited = _edited_files(where)
    if edited:
        raise EngineError(f"{path} holds an engine whose files {edited[:5]} changed after its export (their SHA-256 "
                          "is not the manifest's); refusing to replace them (move them out, or export elsewhere)")


def swap_in(tmp: Path, path: Path, check, what: str = "engine") -> None:
    """Move the finished `what` (an engine; export_triton_repository's Triton model) built in `tmp` to `path`.
    Whatever is at `path` now is checked again where no one else can write to it: an empty directory is removed
    with rmdir (which fails, harmlessly, if a file appeared), anything else is first renamed aside and `check(where)`
    there (it raises EngineError where it may not be replaced), then replaced, and deleted only after the new one is
    in place."""
    set_default_mode(tmp)
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        try:
            if path.exists():
                os.rmdir(path)
            os.rename(tmp, path)
        except OSError as exc:
            raise EngineError(f"could not move the new {what} into {path} ({exc}); another process wrote there during "
                              "the export? Nothing was replaced") from exc
        return
    old = Path(tempfile.mkdtemp(prefix=f".{path.name}-old-", dir=path.parent))
    moved = old / "previous"
    try:
        os.rename(path, moved)
    except OSError as exc:
        old.rmdir()
        raise EngineError(f"could not move the {what} at {path} aside ({exc}); nothing was replaced") from exc
    try:
        check(moved)  # what was there at the last moment, not at the first check
        os.rename(tmp, path)
    except (EngineError, OSError) as exc:
        try:
            os.rename(moved, path)  # put it back: nothing is lost
        except OSError:
            raise EngineError(f"could not move the new {what} into {path} ({exc}); what was there is kept at "
                              f"{moved}") from exc
        old.rmdir()
        if isinstance(exc, EngineError):
            raise
        raise EngineError(f"could not move the new {what} into {path} ({exc}); the previous one is back in place") from exc
    shutil.rmtree(old, ignore_errors=True)


def _eos_ids(model, tokenizer):
    """The ids an engine stops at: the model's generation config's (a chat model's end-of-turn token is often only
    there: Llama-3-Instruct) and the tokenizer's eos, together; an int when there is one, None when there are none."""
    ids = []
    for value in (getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                  getattr(tokenizer, "eos_token_id", None)):
        for i in (value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(i, int) and not isinstance(i, bool) and i not in ids:
                ids.append(i)
    return ids[0] if len(ids) == 1 else ids or None


def _model_entry(fast, tokenizer, model_id: str | None) -> dict:
    from speccomp.models import fingerprint
    from speccomp.runtime.calls import model_pad_id

    model, captured = getattr(fast, "model", None), fast.graph.captured
    return {"name": model_id or getattr(getattr(model, "config", None), "_name_or_path", None) or type(model).__name__,
            "model_type": captured.model_type, "fingerprint": fingerprint(model) if model is not None else None,
            "vocab_size": captured.vocab_size, "max_positions": fast.max_positions,
            "eos_token_id": _eos_ids(model, tokenizer), "pad_token_id": model_pad_id(model, captured.vocab_size),
            "sliding_window_layers": len(captured.sliding_windows)}  # a batch packs rows only where there are none


def export_engine(fast, path, tokenizer=None, overwrite: bool = False, model_id: str | None = None) -> Path:
    """Write `fast` (a SpecModel) as an engine directory at `path`; returns the path."""
    import speccomp

    path = check_destination(path, overwrite)
    dtype = str(fast.kv.dtype).removeprefix("torch.")
    if dtype not in ("float32", "float16"):  # numpy has no bfloat16: the engine would never load (minutes of export)
        raise EngineError(f"the model's KV cache is {dtype}, which an engine's numpy runtime cannot hold; compile the "
                          "model in float32 (or float16) to export it, e.g. model.float()")
    check_tokenizer(tokenizer, fast.graph.captured.vocab_size)
    drafter = drafter_spec(fast.drafter)  # fails early, before any export work
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    try:
        target = _target_onnx(fast, tmp)
        recycling = [p["options"]["top_k"] for p in _parts(drafter) if p["name"] == "token_recycling"]
        vocab = fast.graph.captured.vocab_size  # ONNX's TopK refuses k past its axis; torch's top_ids clamps alike
        proto = (_add_top_ids(target, min(max(recycling), vocab)) if recycling
                 else onnx.load(str(target), load_external_data=False))
        graphs = {"target": _graph_entry(target, proto)}
        graphs.update(_drafter_graphs(fast, drafter, graphs["target"]["outputs"], tmp))
        opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
        kv = fast.kv
        manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "speccomp_version": speccomp.__version__,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "model": _model_entry(fast, tokenizer, model_id),
                    "kv": {"num_layers": kv.num_layers, "num_kv_heads": kv.num_kv_heads, "head_dim": kv.head_dim,
                           "dtype": str(kv.dtype).removeprefix("torch."),
                           "layout": "[layers, 2 (k, v), 1, kv_heads, tokens, head_dim]"},
                    "graphs": graphs, "opset": opset, "max_tree": fast.max_tree, "drafter": drafter,
                    "tokenizer": _tokenizer_entry(tokenizer, tmp)}
        # the tokenizers verified at load as the graphs are: another tokenizer.json encodes prompts into other ids
        manifest["files"] = {f: {"bytes": (tmp / f).stat().st_size, "sha256": sha256(tmp / f)}
                             for f in tokenizer_files(manifest)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        check_destination(path, overwrite)  # again: the export took a while, someone may have written there
        swap_in(tmp, path, lambda where: _check_replaceable(where, overwrite, path))
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path
