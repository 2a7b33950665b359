"""An engine as a Triton Inference Server model repository (its Python backend runs the engine).

    speccomp export-triton engine/ model_repository/ --name smollm2
    tritonserver --model-repository model_repository/          # where a Triton server exists

    model_repository/<name>/config.pbtxt      inputs input_ids INT64 [-1], max_new_tokens INT64 [1] (optional);
                                              output output_ids INT64 [-1] (the new tokens)
    model_repository/<name>/1/model.py        TritonPythonModel: loads the engine once; each execute() call decodes
                                              its requests together as one batch (speccomp's packed batch) and
                                              answers each with its row; a bad request gets its own error
    model_repository/<name>/1/engine/         the engine directory, copied (manifest checked first)

The model.py imports speccomp (and so needs it, with onnxruntime and numpy, in the Triton Python backend's
environment). Nothing here starts a server; tests check the files and run model.py's class against the engine.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from speccomp.engine.export import engine_files, swap_in
from speccomp.engine.runtime import EngineError, check_makeable, read_manifest

CONFIG = """name: "{name}"
backend: "python"
max_batch_size: 0
input [
  {{
    name: "input_ids"
    data_type: TYPE_INT64
    dims: [ -1 ]
  }},
  {{
    name: "max_new_tokens"
    data_type: TYPE_INT64
    dims: [ 1 ]
    optional: true
  }}
]
output [
  {{
    name: "output_ids"
    data_type: TYPE_INT64
    dims: [ -1 ]
  }}
]
instance_group [
  {{
    count: 1
    kind: {kind}
  }}
]
parameters {{
  key: "default_max_new_tokens"
  value: {{ string_value: "{max_new_tokens}" }}
}}
parameters {{
  key: "provider"
  value: {{ string_value: "{provider}" }}
}}
"""

MODEL_PY = '''"""speccomp engine as a Triton Python backend model (written by speccomp export-triton)."""
import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

import speccomp
from speccomp.runtime.calls import left_pad


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.max_new_tokens = int(params.get("default_max_new_tokens", "128"))
        here = Path(args["model_repository"]) / args["model_version"]
        self.engine = speccomp.load(here / "engine", provider=params.get("provider", "cpu"))

    def execute(self, requests):
        prompts, budgets, answers = [], [], [None] * len(requests)
        for i, request in enumerate(requests):
            ids = pb_utils.get_input_tensor_by_name(request, "input_ids").as_numpy().reshape(-1)
            budget = pb_utils.get_input_tensor_by_name(request, "max_new_tokens")
            prompts.append(ids.astype(np.int64))
            budgets.append(int(budget.as_numpy().reshape(-1)[0]) if budget is not None else self.max_new_tokens)
        # requests with the same budget decode together as one batch (rows packed into one forward a step)
        for budget in sorted(set(budgets)):
            self._decode([i for i, b in enumerate(budgets) if b == budget], prompts, budget, answers)
        return answers

    def _decode(self, group, prompts, budget, answers):
        ids, mask = left_pad([prompts[i] for i in group])
        width = ids.shape[1]
        try:
            out = self.engine.generate(ids if len(group) > 1 else ids[0], max_new_tokens=budget,
                                       eos_token_id=self.engine.eos_token_id,
                                       attention_mask=mask if len(group) > 1 else mask[0])  # the ids are text
        except Exception as exc:  # a bad request (too long, bad ids) gets its own error; the others still run
            if len(group) > 1:
                for i in group:
                    self._decode([i], prompts, budget, answers)
                return
            answers[group[0]] = pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc)))
            return
        eos = self.engine.eos_token_id
        eos = set() if eos is None else {eos} if isinstance(eos, int) else set(eos)
        for row, i in enumerate(group):
            new = [int(t) for t in out[row, width:]]
            stop = next((k for k, t in enumerate(new) if t in eos), None)
            new = new if stop is None else new[: stop + 1]
            tensor = pb_utils.Tensor("output_ids", np.array(new, dtype=np.int64))
            answers[i] = pb_utils.InferenceResponse(output_tensors=[tensor])
'''


def _check_model(where: Path, overwrite: bool, model: Path) -> None:
    """The non-empty directory `where` (the model folder `model`, or where it was moved aside) may be replaced: it
    holds a speccomp Triton model and nothing else, and overwrite=True."""
    version, engine = where / "1", where / "1" / "engine"
    model_py = version / "model.py"
    if not (model_py.is_file() and model_py.read_text().startswith(MODEL_PY.splitlines()[0])):
        raise EngineError(f"{model} is not a speccomp Triton model (no speccomp 1/model.py); refusing to replace it "
                          "(choose another --name or repository)")
    # what a speccomp Triton model holds: config.pbtxt, 1/model.py and the files its engine's manifest names
    owned = {where: {"config.pbtxt", "1"}, version: {"model.py", "engine"}, engine: engine_files(engine) or set()}
    foreign = [str(p.relative_to(where)) for folder, names in owned.items() if folder.is_dir()
               for p in sorted(folder.iterdir()) if p.name not in names or p.is_symlink()]
    if foreign:
        raise EngineError(f"{model} holds a speccomp Triton model plus files it did not write {foreign[:5]}; refusing "
                          "to replace it (move those files out, or choose another --name or repository)")
    if not overwrite:
        raise EngineError(f"{model} already holds a speccomp Triton model; pass overwrite=True (CLI: "
                          "--overwrite) to replace it")


def export_triton_repository(engine_dir, out, name: str = "speccomp", max_new_tokens: int = 128,
                             provider: str = "cpu", overwrite: bool = False) -> Path:
    """Write a Triton model repository serving the engine at `engine_dir` under `out/<name>`; returns that folder."""
    from speccomp.errors import OptionError, OptionTypeError
    from speccomp.models import is_broad_directory

    engine_dir = Path(engine_dir).expanduser()
    read_manifest(engine_dir)  # a missing or corrupt engine (its tokenizers too) is named before anything is written
    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "-_" for c in name):
        raise OptionError("name", name, "must be letters, digits, '-' or '_' (a Triton model name)")
    if provider not in ("cpu", "cuda", "tensorrt"):
        raise OptionError("provider", provider, "unknown execution provider", "cpu, cuda or tensorrt")
    if not isinstance(overwrite, bool):
        raise OptionTypeError("overwrite", overwrite, "must be True or False")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise OptionError("max_new_tokens", max_new_tokens, "must be a positive int (the config's default reply "
                          "length)", "e.g. max_new_tokens=128 (the default)")
    if is_broad_directory(out) and Path(out).expanduser().resolve() != Path.cwd().resolve():
        raise OptionError("out", str(out), "is a parent of the working directory, the home directory or the "
                          "filesystem root (Triton would read every folder there as a model)",
                          "give a repository directory such as ./model_repository")
    model = Path(out).expanduser().absolute() / name
    source = engine_dir.expanduser().absolute()
    if model.resolve() == source.resolve() or source.resolve() in model.resolve().parents:
        raise OptionError("out", str(out), f"puts the model inside the engine it copies ({engine_dir}): the copy "
                          "would copy itself", "write the repository outside the engine directory")
    if model.is_symlink() or (model.exists() and not model.is_dir()):
        raise EngineError(f"{model} exists and is not a directory; choose another --name or repository")
    check_makeable(model)
    if model.is_dir() and any(model.iterdir()):
        _check_model(model, overwrite, model)
    # built beside it and swapped in: a failure leaves the old model (and an engine copied from it) as it was
    model.parent.mkdir(parents=True, exist_ok=True)
    new = Path(tempfile.mkdtemp(prefix=f".{name}-new-", dir=model.parent))
    try:
        (new / "1").mkdir()
        (new / "1" / "engine").mkdir()
        for file in sorted(engine_files(engine_dir) or ()):  # the engine's own files, not what else lies beside them
            if (engine_dir / file).is_file():
                shutil.copyfile(engine_dir / file, new / "1" / "engine" / file)
        if not (new / "1" / "engine" / "manifest.json").is_file():
            raise EngineError(f"copying the engine {engine_dir} failed")
        kind = "KIND_CPU" if provider == "cpu" else "KIND_GPU"
        (new / "config.pbtxt").write_text(CONFIG.format(name=name, kind=kind, max_new_tokens=max_new_tokens,
                                                        provider=provider))
        (new / "1" / "model.py").write_text(MODEL_PY)
        swap_in(new, model, lambda where: _check_model(where, overwrite, model), what="Triton model")
    finally:
        if new.exists():
            shutil.rmtree(new, ignore_errors=True)
    return model
