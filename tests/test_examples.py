"""Tests of the builtin modelled example profiles (python/tensorplace/examples.py)."""

import importlib
import importlib.util
import json
import math
import os
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULE_PATH = os.path.join(ROOT, "python", "tensorplace", "examples.py")
BUNDLED_DIR = os.path.join(ROOT, "python", "tensorplace", "examples")


def _load_examples():
    try:
        return importlib.import_module("tensorplace.examples")
    except ImportError:
        # The package __init__ may import the compiled extension; load the module by path.
        spec = importlib.util.spec_from_file_location("tensorplace_examples_under_test", MODULE_PATH)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


ex = _load_examples()
NAMES = ex.names()

UNIT_FIELDS = {
    "name": str, "kind": str, "inputs": list, "model_inputs": list, "fwd_time": float,
    "bwd_time": float, "act_bytes": int, "output_bytes": int, "output_saved": bool,
    "read_by": list, "held_input_bytes": int, "fwd_transient_bytes": int,
    "bwd_transient_bytes": int, "grad_bytes": int,
}
SIZE_FIELDS = ["act_bytes", "output_bytes", "held_input_bytes", "fwd_transient_bytes",
               "bwd_transient_bytes", "grad_bytes"]

# Known parameter totals of the published architectures (1000 classes; plain20: 10 classes).
KNOWN_PARAMETERS = {
    "vgg16": 138.36e6,
    "resnet50": 25.56e6,
    "mobilenet_v1": 4.2e6,
    "mobilenet_v2": 3.5e6,
    "squeezenet": 1.248e6,
    "plain20": 0.27e6,
    "inception_v3": 23.83e6,
}


def check_structure(p):
    """Everything docs/formats.md and the Rust validator require, plus the ownership rule."""
    assert p["format"] == "tensorplace.profile"
    assert p["version"] == 1
    assert set(p["memory"]) == {"parameters", "optimizer_state", "inputs", "workspace"}
    assert all(isinstance(v, int) and v >= 0 for v in p["memory"].values())
    for bw in ("d2h_bandwidth", "h2d_bandwidth"):
        assert isinstance(p[bw], float) and math.isfinite(p[bw]) and p[bw] > 0
    assert p["measured"] == {}
    units = p["units"]
    n = len(units)
    assert n > 0
    assert len({u["name"] for u in units}) == n, "unit names must be unique"
    for i, u in enumerate(units):
        assert set(u) == set(UNIT_FIELDS), u["name"]
        for field, typ in UNIT_FIELDS.items():
            assert type(u[field]) is typ, (u["name"], field, u[field])
        for j in u["inputs"]:
            assert isinstance(j, int) and 0 <= j < i, (u["name"], j)
        for j in u["read_by"]:
            assert isinstance(j, int) and i <= j < n, (u["name"], j)
        assert u["read_by"] == sorted(set(u["read_by"]))
        assert all(isinstance(m, int) and m >= 0 for m in u["model_inputs"])
        for f in SIZE_FIELDS:
            assert u[f] >= 0, (u["name"], f)
        for f in ("fwd_time", "bwd_time"):
            assert math.isfinite(u[f]) and u[f] > 0, (u["name"], f)
        if u["act_bytes"] > 0:
            assert u["read_by"], u["name"]
        if u["output_saved"]:
            assert u["act_bytes"] >= u["output_bytes"] > 0
        # held inputs: the outputs of its input units that nobody saves
        held = sum(units[j]["output_bytes"] for j in set(u["inputs"]) if not units[j]["output_saved"])
        assert u["held_input_bytes"] == held, u["name"]
        # every unit's output is read by a later unit in forward, except the loss
        if i < n - 1:
            assert any(i in v["inputs"] for v in units[i + 1:]), f"{u['name']} output is dead"
    assert units[-1]["kind"] == "loss" and units[-1]["model_inputs"] == [1]
    assert sum(u["grad_bytes"] for u in units) == p["memory"]["parameters"]


def check_ownership(p):
    """Who saves what (module docstring): each saving consumer is in the producer's read_by."""
    units = p["units"]
    for i, u in enumerate(units):
        k = u["kind"]
        if k in ("conv", "linear", "norm"):
            for j in u["inputs"]:
                assert i in units[j]["read_by"] and units[j]["output_saved"], (u["name"], units[j]["name"])
        if k == "activation":
            if p["model"] == "mobilenet_v2":
                # ReLU6 (hardtanh, not in place) saves its input
                assert i in units[u["inputs"][0]]["read_by"]
            else:
                # ReLU saves its output
                assert i in u["read_by"] and u["output_saved"]
        if k in ("add", "concat"):
            for j in u["inputs"]:
                assert i not in units[j]["read_by"]  # add and cat save nothing
        if k == "norm":
            c_bytes = u["grad_bytes"]  # 2 x C parameters x 4 bytes == 2 x C stats x 4 bytes
            assert u["act_bytes"] - (u["output_bytes"] if u["output_saved"] else 0) == c_bytes
            assert i in u["read_by"]
        if k == "dropout":
            assert u["act_bytes"] - (u["output_bytes"] if u["output_saved"] else 0) == u["output_bytes"] // 4
        if k == "pool":
            # max pools own their int64 indices (2 x the fp32 output); average pools own nothing
            extra = u["act_bytes"] - (u["output_bytes"] if u["output_saved"] else 0)
            assert extra in (0, 2 * u["output_bytes"]), u["name"]
            assert (extra > 0) == (i in u["read_by"])
    # bwd transient: gradient of the output + gradients of unit inputs
    for u in units:
        expect = u["output_bytes"] + sum(units[j]["output_bytes"] for j in u["inputs"])
        assert u["bwd_transient_bytes"] == expect, u["name"]


@pytest.fixture(scope="module", params=NAMES)
def model_profile(request):
    return ex.profile(request.param)


def test_names_cover_home_models():
    for required in ["vgg16", "resnet50", "squeezenet", "plain20", "inception_v3"]:
        assert required in NAMES
    assert "mobilenet_v1" in NAMES or "mobilenet_v2" in NAMES


def test_structure(model_profile):
    check_structure(model_profile)
    check_ownership(model_profile)


def test_unit_and_parameter_counts_match_docstring(model_profile):
    table = {}
    for line in ex.__doc__.splitlines():
        m = re.match(r"^\s{4}([a-z0-9_]+)\s+(\d+)\s+(\d+)\s", line)
        if m:
            table[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    assert set(table) == set(NAMES)
    name = model_profile["model"]
    n_units = len(model_profile["units"])
    params = model_profile["memory"]["parameters"] // 4
    assert table[name] == (n_units, params)
    assert ex.UNIT_COUNTS[name] == n_units
    assert ex.PARAMETER_COUNTS[name] == params == ex.parameter_count(model_profile)


def test_parameter_counts_match_published_totals(model_profile):
    name = model_profile["model"]
    params = model_profile["memory"]["parameters"] / 4
    assert abs(params - KNOWN_PARAMETERS[name]) / KNOWN_PARAMETERS[name] < 0.02, (name, params)


def test_inception_has_about_300_units():
    n = len(ex.profile("inception_v3")["units"])
    assert 280 <= n <= 330


def test_resnet50_residual_adds():
    p = ex.profile("resnet50")
    units = p["units"]
    adds = [(i, u) for i, u in enumerate(units) if u["kind"] == "add"]
    assert len(adds) == 16  # 3 + 4 + 6 + 3 bottleneck blocks
    projections = 0
    for i, u in adds:
        assert len(u["inputs"]) == 2
        a, b = u["inputs"]
        assert units[a]["kind"] == "norm"  # bn3
        # the shortcut is either the block input (a ReLU far back: a skip connection) or the
        # projection's BN
        if units[b]["kind"] == "norm":
            projections += 1
            assert units[b]["name"].endswith("downsample.1")
        else:
            assert units[b]["kind"] == "activation" and i - b == 9
        # the add output is read by the block's final ReLU only
        assert units[i + 1]["kind"] == "activation" and units[i + 1]["inputs"] == [i]
        assert not u["output_saved"] and u["act_bytes"] == 0
    assert projections == 4
    # the block input is saved by the next conv (and by the downsample conv), not by the add
    first = units.index(next(u for u in units if u["name"] == "layer1.0.downsample.0"))
    maxpool = next(i for i, u in enumerate(units) if u["name"] == "maxpool")
    assert first in units[maxpool]["read_by"]


def test_inception_concats():
    p = ex.profile("inception_v3")
    units = p["units"]
    by_arity = {}
    for u in units:
        if u["kind"] == "concat":
            by_arity[len(u["inputs"])] = by_arity.get(len(u["inputs"]), 0) + 1
    # 4 branches: 3 InceptionA + 4 InceptionC + 2 InceptionE; 3 branches: InceptionB, InceptionD;
    # 2: the two inner concats of each InceptionE
    assert by_arity == {4: 9, 3: 2, 2: 4}
    cat = next(i for i, u in enumerate(units) if u["name"] == "Mixed_5b.cat")
    assert units[cat]["output_bytes"] == 32 * 256 * 35 * 35 * 4
    # the module input feeds the four branches: three 1x1 convs and the average pool
    inp = units[cat]["inputs"]
    module_input = next(i for i, u in enumerate(units) if u["name"] == "maxpool2")
    readers = [i for i, u in enumerate(units) if module_input in u["inputs"]]
    assert len(readers) == 4
    assert sorted(units[r]["kind"] for r in readers) == ["conv", "conv", "conv", "pool"]
    assert set(readers) <= set(units[module_input]["read_by"])
    assert all(units[j]["kind"] == "activation" for j in inp)


def test_squeezenet_fire_modules():
    units = ex.profile("squeezenet")["units"]
    cats = [(i, u) for i, u in enumerate(units) if u["kind"] == "concat"]
    assert len(cats) == 8  # fire2 .. fire9
    for i, u in cats:
        assert len(u["inputs"]) == 2
        squeeze_relu = units[u["inputs"][0]]["inputs"][0]
        squeeze_relu = units[squeeze_relu]["inputs"][0]
        # the squeeze output feeds both expand convolutions
        expand_convs = [j for j, v in enumerate(units) if squeeze_relu in v["inputs"]]
        assert len(expand_convs) == 2
        assert all(units[j]["kind"] == "conv" for j in expand_convs)
    assert units[-2]["output_bytes"] == 32 * 1000 * 4


def test_linear_models_are_chains():
    for name in ("vgg16", "plain20", "mobilenet_v1"):
        units = ex.profile(name)["units"]
        for i, u in enumerate(units[1:], start=1):
            assert u["inputs"] == [i - 1], (name, u["name"])


def test_mobilenet_v2_residuals():
    units = ex.profile("mobilenet_v2")["units"]
    adds = [u for u in units if u["kind"] == "add"]
    assert len(adds) == 10
    assert all(len(u["inputs"]) == 2 for u in adds)
    named = {u["name"]: u for u in units}
    # block 2 expands 16 -> 96 channels; its depthwise 3x3 conv has 96 x 9 weights
    assert named["features.2.conv.0.0"]["grad_bytes"] == 4 * 16 * 96
    assert named["features.2.conv.1.0"]["grad_bytes"] == 4 * 96 * 9
    assert named["features.2.conv.2"]["grad_bytes"] == 4 * 96 * 24


def test_known_output_shapes():
    units = {u["name"]: u for u in ex.profile("resnet50", batch_size=2)["units"]}
    assert units["conv1"]["output_bytes"] == 2 * 64 * 112 * 112 * 4
    assert units["maxpool"]["output_bytes"] == 2 * 64 * 56 * 56 * 4
    assert units["layer4.2.relu3"]["output_bytes"] == 2 * 2048 * 7 * 7 * 4
    units = {u["name"]: u for u in ex.profile("inception_v3", batch_size=1)["units"]}
    assert units["Mixed_6e.cat"]["output_bytes"] == 768 * 17 * 17 * 4
    assert units["Mixed_7c.cat"]["output_bytes"] == 2048 * 8 * 8 * 4
    units = {u["name"]: u for u in ex.profile("squeezenet", batch_size=1)["units"]}
    assert units["features.2"]["output_bytes"] == 96 * 54 * 54 * 4  # ceil-mode pool
    assert units["features.12.cat"]["output_bytes"] == 512 * 13 * 13 * 4
    units = {u["name"]: u for u in ex.profile("plain20", batch_size=1)["units"]}
    assert units["layer3.5.relu"]["output_bytes"] == 64 * 8 * 8 * 4


# Bytes of saved tensors that torch's autograd actually kept (saved_tensors_hooks, unique
# storages, parameters/buffers/inputs excluded) for one training step of the torchvision models
# with in-place ReLUs turned off, batch 2, on CPU (torch 2.x). Two CPU differences from the
# modelled GPU: the 4-byte total_weight scalar of nll_loss, and dropout's float mask (4 B per
# element, the model counts CUDA's 1-byte bool mask).
TORCH_SAVED_BYTES = {  # name: (image size, measured bytes)
    "vgg16": (64, 12250948),
    "resnet50": (64, 14163268),
    "mobilenet_v2": (64, 12833860),
    "squeezenet": (64, 4689796),
    "inception_v3": (160, 46751044),
}


@pytest.mark.parametrize("name", sorted(TORCH_SAVED_BYTES))
def test_saved_bytes_match_torch_measurement(name):
    size, measured = TORCH_SAVED_BYTES[name]
    p = ex.profile(name, batch_size=2, image_size=size)
    act = sum(u["act_bytes"] for u in p["units"])
    masks = sum(u["act_bytes"] - (u["output_bytes"] if u["output_saved"] else 0)
                for u in p["units"] if u["kind"] == "dropout")
    assert act + 3 * masks + 4 == measured


def test_batch_scaling(model_profile):
    name = model_profile["model"]
    p1, p2, p4 = (ex.profile(name, batch_size=b) for b in (1, 2, 4))
    assert len(p1["units"]) == len(p2["units"]) == len(p4["units"])
    for f in ("parameters", "optimizer_state", "workspace"):
        assert p1["memory"][f] == p4["memory"][f]
    assert p4["memory"]["inputs"] == 4 * p1["memory"]["inputs"]
    last = len(p1["units"]) - 1
    for i, (a, b, c) in enumerate(zip(p1["units"], p2["units"], p4["units"])):
        assert a["grad_bytes"] == c["grad_bytes"]
        if i != last:  # the loss output is one scalar whatever the batch
            assert c["output_bytes"] == 4 * a["output_bytes"]
            assert c["held_input_bytes"] == 4 * a["held_input_bytes"]
            assert c["bwd_transient_bytes"] == 4 * a["bwd_transient_bytes"]
        if a["kind"] == "norm":  # per-channel statistics do not scale with the batch
            assert c["act_bytes"] - b["act_bytes"] == 2 * (b["act_bytes"] - a["act_bytes"])
            assert c["act_bytes"] < 4 * a["act_bytes"]
        else:
            assert c["act_bytes"] == 4 * a["act_bytes"]
        for f in ("fwd_time", "bwd_time"):
            assert a[f] <= b[f] <= c[f]
        assert (a["inputs"], a["read_by"], a["output_saved"]) == (c["inputs"], c["read_by"], c["output_saved"])


def test_device_model_times():
    p = ex.profile("vgg16")
    units = p["units"]
    assert p["d2h_bandwidth"] == p["h2d_bandwidth"] == 12e9
    for i, u in enumerate(units):
        if u["kind"] in ("conv", "linear"):
            factor = 1 if u["model_inputs"] else 2
            assert u["bwd_time"] == pytest.approx(factor * u["fwd_time"], rel=1e-5)
    # a large conv is compute-bound at the stated 8 TFLOP/s: features.2 is 64->64 3x3 at 224x224
    conv = units[2]
    flops = 2 * 32 * 64 * 224 * 224 * 64 * 9
    assert conv["fwd_time"] == pytest.approx(5e-6 + flops / 8e12, rel=1e-5)
    # a ReLU is bandwidth-bound: read + write at 4.5e11 B/s
    relu = units[1]
    assert relu["fwd_time"] == pytest.approx(5e-6 + 2 * relu["output_bytes"] / 4.5e11, rel=1e-5)
    cpu = ex.profile("vgg16", device="cpu-model")
    assert sum(u["fwd_time"] for u in cpu["units"]) > 10 * sum(u["fwd_time"] for u in units)
    assert [u["act_bytes"] for u in cpu["units"]] == [u["act_bytes"] for u in units]


def test_optimizer_state():
    sgd = ex.profile("resnet50")
    adam = ex.profile("resnet50", optimizer="adam")
    assert sgd["memory"]["optimizer_state"] == 0
    assert adam["memory"]["optimizer_state"] == 2 * sgd["memory"]["parameters"]
    assert ex.profile("resnet50", optimizer="momentum")["memory"]["optimizer_state"] == sgd["memory"]["parameters"]
    assert sgd["units"] == adam["units"]


def test_inputs_memory():
    p = ex.profile("inception_v3", batch_size=8)
    assert p["memory"]["inputs"] == 8 * (3 * 299 * 299 * 4 + 8)
    assert p["units"][0]["model_inputs"] == [0]
    assert p["batch_size"] == 8 and p["model"] == "inception_v3" and p["device"] == "gpu-model"


def test_bad_arguments():
    with pytest.raises(ValueError):
        ex.profile("alexnet")
    with pytest.raises(ValueError):
        ex.profile("vgg16", batch_size=0)
    with pytest.raises(ValueError):
        ex.profile("vgg16", device="tpu")
    with pytest.raises(ValueError):
        ex.profile("vgg16", optimizer="lion")
    with pytest.raises(ValueError, match="too small"):
        ex.profile("inception_v3", image_size=64)


def test_image_size_and_classes():
    small = ex.profile("resnet50", image_size=32)
    check_structure(small)
    big = ex.profile("resnet50")
    assert sum(u["act_bytes"] for u in small["units"]) < sum(u["act_bytes"] for u in big["units"]) / 20
    assert small["memory"]["parameters"] == big["memory"]["parameters"]
    ten = ex.profile("resnet50", num_classes=10)
    assert ten["memory"]["parameters"] // 4 == 25557032 - 2048 * 990 - 990


def test_json_round_trip(model_profile):
    text = ex.to_json(model_profile)
    assert json.loads(text) == model_profile
    assert json.loads(json.dumps(model_profile)) == model_profile


def test_bundled_files_are_current():
    for name in NAMES:
        path = os.path.join(BUNDLED_DIR, f"{name}.json")
        assert os.path.getsize(path) < 300 * 1024, path
        with open(path, encoding="utf-8") as f:
            text = f.read()
        assert text == ex.to_json(ex.profile(name, batch_size=32)), f"{path} is stale: re-run write_all"
        assert ex.load_bundled(name) == json.loads(text)
        check_structure(json.loads(text))


def test_write_all_and_cli(tmp_path):
    paths = ex.write_all(str(tmp_path / "a"), batch_size=4)
    assert sorted(os.path.basename(p) for p in paths) == sorted(f"{n}.json" for n in NAMES)
    assert json.loads(open(paths[0]).read()) == ex.profile(NAMES[0], batch_size=4)
    assert ex.main(["--write", str(tmp_path / "b"), "--batch-size", "2"]) == 0
    assert json.loads((tmp_path / "b" / "plain20.json").read_text())["batch_size"] == 2


_MIN_SIZE = {"inception_v3": 75, "squeezenet": 32}


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(NAMES), st.integers(1, 512), st.integers(0, 300))
def test_random_shapes_validate(name, batch, extra):
    size = _MIN_SIZE.get(name, 32) + extra
    p = ex.profile(name, batch_size=batch, image_size=size)
    check_structure(p)
    check_ownership(p)
    assert len(p["units"]) == ex.UNIT_COUNTS[name]


def test_core_validator_accepts_examples():
    core = pytest.importorskip("tensorplace._core")
    for name in NAMES:
        core.validate_profile(ex.to_json(ex.profile(name)))
        with open(os.path.join(BUNDLED_DIR, f"{name}.json"), encoding="utf-8") as f:
            core.validate_profile(f.read())
        core.validate_profile(json.dumps(ex.profile(name, batch_size=3, image_size=96 if name != "inception_v3" else 139)))
