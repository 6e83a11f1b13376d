"""safe_load and load_export_program: weights load; a pickle payload, a damaged file or an archive that would run
code is one UnreadableFile naming the file, and nothing in it runs (the payload would create a marker file)."""

import io
import json
import pickle
import zipfile

import numpy as np
import pytest
import torch

from fedssl.core.safe_load import UnreadableFile, load_export_program, safe_load


class Payload:
    """Unpickling it creates ``marker`` (what a real payload would do with os.system)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def write_payload(path, marker, fmt):
    if fmt == "torch_zip":
        torch.save({"model": {"w": torch.ones(2), "evil": Payload(marker)}}, path)
    elif fmt == "torch_legacy":
        torch.save({"model": {"evil": Payload(marker)}}, path, _use_new_zipfile_serialization=False)
    elif fmt == "raw_pickle":
        path.write_bytes(pickle.dumps({"model": Payload(marker)}))
    else:  # a numpy object array (its elements are arbitrary Python objects)
        torch.save({"o": np.array([{"a": 1}, "s"], dtype=object)}, path)


def test_loads_tensors_numpy_arrays_and_safetensors(tmp_path):
    path = tmp_path / "m.pt"
    torch.save({"model": {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": torch.ones(2)}, "round": 3,
                "rng": torch.get_rng_state()}, path)
    data = safe_load(str(path))
    assert data["round"] == 3 and torch.equal(data["model"]["b"], torch.ones(2))
    np.testing.assert_array_equal(data["model"]["w"], np.arange(6, dtype=np.float32).reshape(2, 3))
    from safetensors.torch import save_file

    save_file({"w": torch.arange(3.0)}, str(tmp_path / "m.safetensors"))
    assert torch.equal(safe_load(str(tmp_path / "m.safetensors"))["w"], torch.arange(3.0))


@pytest.mark.parametrize("fmt", ["torch_zip", "torch_legacy", "raw_pickle", "numpy_object"])
def test_a_pickle_payload_is_refused_unrun_and_the_error_names_the_file(tmp_path, fmt):
    path, marker = tmp_path / f"evil_{fmt}.pt", tmp_path / "ran"
    write_payload(path, marker, fmt)
    with pytest.raises(UnreadableFile) as e:
        safe_load(str(path))
    assert not marker.exists()
    assert str(path) in str(e.value) and isinstance(e.value, ValueError)
    assert "weights_only" not in str(e.value)  # never torch's advice to load it with weights_only=False
    if fmt != "raw_pickle":  # a raw pickle stream is not a torch file to begin with
        assert "refused before anything in it ran" in str(e.value)


@pytest.mark.parametrize("case, problem", [
    ("empty", "is empty (0 bytes)"), ("truncated", "is truncated or not a weight"),
    ("garbage", "is truncated or not a weight"), ("missing", "does not exist"), ("folder", "is not a regular file"),
    ("bad_safetensors", "not a safetensors file")])
def test_a_damaged_file_is_one_error_naming_it(tmp_path, case, problem):
    path = tmp_path / ("m.safetensors" if case == "bad_safetensors" else "m.pt")
    torch.save({"w": torch.ones(100)}, tmp_path / "full.pt")
    full = (tmp_path / "full.pt").read_bytes()
    if case == "folder":
        path.mkdir()
    elif case != "missing":
        path.write_bytes({"empty": b"", "truncated": full[: len(full) // 2]}.get(case, b"not a weight file"))
    with pytest.raises(UnreadableFile) as e:
        safe_load(str(path))
    assert e.value.path == str(path) and str(e.value).startswith(str(path)) and problem in e.value.problem


# --------------------------------------------------------------------------- torch.export programs


class Twice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((3,), 2.0))

    def forward(self, x):
        return x * self.w


def export(path, dynamic=False):
    shapes = ({0: torch.export.Dim("batch", min=2, max=64)},) if dynamic else None
    torch.export.save(torch.export.export(Twice(), (torch.ones(4, 3),), dynamic_shapes=shapes), str(path))
    return path


def rewrite(src, dst, edit):
    """Copy the archive ``src`` to ``dst`` with ``edit(name, bytes) -> bytes | None`` applied (None: unchanged);
    ``edit("", None)`` may return extra ``{name: bytes}`` to add."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        root = zin.namelist()[0].split("/")[0]
        for info in zin.infolist():
            data = zin.read(info.filename)
            new = edit(info.filename.split("/", 1)[1], data)
            zout.writestr(info, data if new is None else new)
        for name, data in (edit("", None) or {}).items():
            zout.writestr(f"{root}/{name}", data)
    return dst


def pickled_weight(marker):
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)

    def edit(name, data):
        if name.endswith("model_weights_config.json"):
            config = json.loads(data)
            config["config"]["w"]["use_pickle"] = True
            return json.dumps(config).encode()
        return buf.getvalue() if name == "data/weights/weight_0" else None
    return edit


def in_graph(key, value):
    def edit(name, data):
        if name != "models/model.json":
            return None
        program = json.loads(data)

        def patch(node):
            if isinstance(node, dict):
                if key in node and (key != "target" or "inputs" in node):
                    node[key] = value
                for v in node.values():
                    patch(v)
            elif isinstance(node, list):
                for v in node:
                    patch(v)
        patch(program)
        return json.dumps(program).encode()
    return edit


def test_an_export_program_of_torch_operators_loads_and_runs(tmp_path):
    for dynamic in (False, True):
        program = load_export_program(str(export(tmp_path / f"p{dynamic}.pt2", dynamic)))
        assert torch.equal(program.module()(torch.ones(4, 3)), torch.full((4, 3), 2.0))


@pytest.mark.parametrize("attack, needle", [
    ("pickled_weight", "entry data/weights/weight_0 that holds a Python object"),
    ("shape_expression", "shape expression that is not arithmetic"),
    ("graph_target", "calls 'torch.os.system', which is not a torch operator"),
    ("native_code", "compiled native code"),
])
def test_an_export_program_that_would_run_code_is_refused_unrun(tmp_path, attack, needle):
    marker = tmp_path / "ran"
    expression = f"__import__('builtins').open('{marker}', 'w') and s0"  # sympify evals it: creates the marker
    edits = {"pickled_weight": pickled_weight(marker), "shape_expression": in_graph("expr_str", expression),
             "graph_target": in_graph("target", "torch.os.system"),
             "native_code": lambda name, data: {"data/aotinductor/model/model.so": b"\x7fELF"} if name == "" else None}
    good = export(tmp_path / "good.pt2", dynamic=attack == "shape_expression")
    evil = rewrite(good, tmp_path / "evil.pt2", edits[attack])
    with pytest.raises(UnreadableFile, match=needle) as e:
        load_export_program(str(evil))
    assert not marker.exists() and str(evil) in str(e.value)
