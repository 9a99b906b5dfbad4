"""Two copies of tfcompat in one process (a framework's vendored copy beside the installed package): each works
exactly on the models it patched, and any mix of the two is a clear TfcompatError, never a wrong number or a
RecursionError. The oracle: transformers' own model on the padded batch."""

import copy
import copyreg
import importlib
import os
import pickle
import subprocess
import sys
import types

import pytest
import torch

import tfcompat
from tfcompat.errors import PackingError
from tfcompat.packing import pack, packed, unpack
from tfcompat.testing import tiny_model

from _helpers import BOUNDARY_ONLY

pytestmark = BOUNDARY_ONLY  # module attributes and tfcompat's own carriers: the boundary releases hold them

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def vendored(tmp_path_factory):
    """A ``tfcompat vendor`` copy imported in this process as ``copyproj._vendor.tfcompat``."""
    base = tmp_path_factory.mktemp("copies")
    dest = base / "copyproj" / "_vendor" / "tfcompat"
    out = subprocess.run([sys.executable, "-m", "tfcompat", "vendor", str(dest), "--no-tools"], capture_output=True,
                         text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=120)
    assert out.returncode == 0, out.stderr
    sys.path.insert(0, str(base))
    try:
        other = importlib.import_module("copyproj._vendor.tfcompat")
        importlib.import_module("copyproj._vendor.tfcompat.packing")
        yield other
    finally:
        sys.path.remove(str(base))
        for name in [m for m in sys.modules if m.split(".")[0] == "copyproj"]:
            del sys.modules[name]


def _batch():
    ids = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 0, 0]])
    mask = (ids != 0).long()
    return ids, mask, pack(ids, mask)


def _packed_logits(model, pk):
    return unpack(model(input_ids=pk.input_ids, position_ids=pk.position_ids).logits, pk)


@pytest.mark.parametrize("order", ["installed first", "vendored first"])
def test_one_model_patched_by_two_copies_refuses_the_second(vendored, order):
    ids, mask, pk = _batch()
    model = tiny_model("qwen2")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    first, second = (tfcompat, vendored) if order == "installed first" else (vendored, tfcompat)
    first.patch(model)
    # each copy raises its own classes: the second copy's ModelError (a TfcompatError of that copy)
    refused = importlib.import_module(f"{second.__name__}.errors")
    with pytest.raises(refused.ModelError, match="patched by another copy of tfcompat") as err:
        second.patch(model)
    assert first.__name__ in str(err.value) and second.__name__ in str(err.value)
    with pytest.raises(refused.ModelError, match="patched by another copy of tfcompat"):
        second.unpatch(model)
    # the first copy's patch is intact: exact, no recursion
    with torch.no_grad():
        got = _packed_logits(model, pk)
    assert (got - want)[mask.bool()].abs().max() < 1e-5
    assert first.unpatch(model)
    second.patch(model)  # unpatched by its own copy: the other copy may patch it now
    with torch.no_grad():
        got = _packed_logits(model, pk)
    assert (got - want)[mask.bool()].abs().max() < 1e-5


def test_a_model_of_one_copy_inside_the_other_copys_packed_block_is_refused(vendored):
    ids, mask, pk = _batch()
    model = tiny_model("qwen2")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    tfcompat.patch(model)
    # the same copy: exact from packed(cu) alone
    with torch.no_grad(), packed(pk.cu_seqlens, pk.max_seqlen):
        got = unpack(model(input_ids=pk.input_ids).logits, pk)
    assert (got - want)[mask.bool()].abs().max() < 1e-5
    # the other copy's block: this copy's model cannot see it, so the block refuses to end
    refused = importlib.import_module(f"{vendored.__name__}.errors")
    with pytest.raises(refused.PackingError, match="no model patched by this copy of tfcompat"):
        with torch.no_grad(), vendored.packing.packed(pk.cu_seqlens, pk.max_seqlen):
            model(input_ids=pk.input_ids)
    # and a model patched by the vendored copy is exact inside the vendored block
    other = tiny_model("qwen2")
    vendored.patch(other)
    with torch.no_grad(), vendored.packing.packed(pk.cu_seqlens, pk.max_seqlen):
        got = unpack(other(input_ids=pk.input_ids).logits, pk)
    assert (got - want)[mask.bool()].abs().max() < 1e-5


def test_an_unpatched_model_inside_packed_is_refused():
    _, _, pk = _batch()
    model = tiny_model("qwen2")
    with pytest.raises(PackingError, match="read these boundaries"):
        with torch.no_grad(), packed(pk.cu_seqlens):
            model(input_ids=pk.input_ids)


def test_no_process_wide_pickling_hook():
    """Importing every module of the package registers nothing with copyreg; a patched model still pickles (its
    shared forwards are bound again at the text model's first call) and equals the original."""
    import pkgutil

    before = dict(copyreg.dispatch_table)
    for info in pkgutil.walk_packages(tfcompat.__path__, "tfcompat."):
        try:
            importlib.import_module(info.name)
        except ModuleNotFoundError as exc:  # an optional dependency (triton, flash-attn) absent here
            assert exc.name.split(".")[0] in ("triton", "flash_attn"), exc
    assert copyreg.dispatch_table == before
    assert types.MethodType not in copyreg.dispatch_table
    ids, mask, pk = _batch()
    model = tiny_model("qwen3")
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    tfcompat.patch(model)
    for other in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        with torch.no_grad():
            got = _packed_logits(other, pk)
        assert (got - want)[mask.bool()].abs().max() < 1e-5
        attention = other.model.layers[0].self_attn
        assert attention.forward.__func__.__qualname__ == "tfcompat_attention_forward"
