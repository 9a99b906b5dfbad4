"""FSDP2 over data parallel x Ulysses (or context parallel) over the sequence, on one 2x2 DeviceMesh of 4
gloo ranks.

Two AdamW steps of the patched, packed, sliced, checkpointed model equal the single-process run of the
unpatched model on the padded batches (loss of each step and the final parameters). Spawned once.
"""

import functools

import pytest
import torch
import torch.distributed as dist

import tfcompat
from tfcompat.packing import pack, unpack
from tfcompat.testing import families
from tfcompat.ulysses import gather_from_ranks, slice_for_rank

from _dist import assert_ok, merged, run_cases, spawn
from _helpers import SPAWNED_RANKS_SKIPPED, close_to_model, installed, linear_attention, patchable  # noqa: F401
from _models import padded, tiny_model, tiny_sequence

SPECS = families(installed_only=False)  # the family facts, from the public face


# the workers are spawned once for the module: under pytest-xdist its tests stay on one worker
pytestmark = pytest.mark.xdist_group("mesh")

if SPAWNED_RANKS_SKIPPED:
    pytest.skip("the 2x2 mesh (FSDP2's and DeviceMesh's plumbing around the Ulysses forward every environment "
                "proves) runs on the boundary releases of the matrix (tox.ini says which)", allow_module_level=True)

HAVE = patchable()
# the mesh is a mechanism: one VL family with 4-row ids (deepstack where the release has it); the text path
# under Ulysses is test_distributed's
MESH_FAMILIES = [n for n in ("qwen3_vl" if "qwen3_vl" in HAVE else "qwen2_vl",) if n in HAVE]
STEPS = 2
PRELOAD_FAMILIES = MESH_FAMILIES  # imported once in the forkserver (_dist), not in every rank


def _batches(name):
    """One padded micro-batch per data-parallel rank."""
    return [padded([tiny_sequence(name, text=6), tiny_sequence(name, text=3)]),
            padded([tiny_sequence(name, text=4), tiny_sequence(name, text=5), tiny_sequence(name, text=2)])]


def _loss(logits, ids, mask):
    labels = torch.where(mask.bool(), ids, -100)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                             ignore_index=-100, reduction="sum")


def _reference(name):
    model = tiny_model(name)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss = sum(_loss(model(input_ids=ids, attention_mask=mask).logits, ids, mask) for ids, mask in _batches(name))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _mesh_case(rank, world, name, how="ulysses"):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    dp, sp = mesh["dp"].get_local_rank(), mesh["sp"].get_group()
    want_losses, want = _reference(name)

    model = tiny_model(name)
    split = {"group": sp} if how == "ulysses" else {"context_group": sp}  # the second mesh dimension
    tfcompat.patch(model, **({"ulysses_group": sp} if how == "ulysses" else {"context_group": sp}))
    model.train()
    tfcompat.enable_checkpointing(model)
    for layer in [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]:
        fully_shard(layer, mesh=mesh)  # HSDP: replicate over dp, shard over sp
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    ids, mask = _batches(name)[dp]
    pk = pack(ids, mask, vision=SPECS[name].vision)
    total = pk.input_ids.shape[1]
    losses = []
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        local = model(input_ids=slice_for_rank(pk.input_ids, dim=1, **split),
                      position_ids=slice_for_rank(pk.position_ids, dim=pk.position_ids.dim() - 1, **split)).logits
        logits = unpack(gather_from_ranks(local, dim=1, length=total, **split), pk)
        # every sp rank computes the loss of the whole row from the gathered logits, and the gather's backward
        # keeps each rank's own slice: the 4 ranks' gradients sum to that of both micro-batches' losses, and
        # FSDP averages them over the 4 ranks, hence the factor world
        loss = _loss(logits, ids, mask)
        (loss * world).backward()
        opt.step()
        total_loss = loss.detach().clone()
        dist.all_reduce(total_loss)
        losses.append(total_loss.item() / 2)  # each micro-batch's loss was summed by its 2 sp ranks
    assert losses == pytest.approx(want_losses, rel=1e-4), (losses, want_losses)
    for n, p in model.named_parameters():
        close_to_model(p.detach().full_tensor(), want[n], n)


def _cases(rank, world):
    cases = [(f"mesh:{n}", functools.partial(_mesh_case, rank, world, n)) for n in MESH_FAMILIES]
    cases += [(f"mesh_cp:{n}", functools.partial(_mesh_case, rank, world, n, "context")) for n in MESH_FAMILIES]
    return run_cases(rank, cases)


@pytest.fixture(scope="module")
def outcomes():
    from torch.distributed import fsdp

    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no FSDP2 fully_shard")
    return merged(spawn(_cases, 4, timeout=900, collect=True))


@pytest.mark.parametrize("name", MESH_FAMILIES)
def test_fsdp2_times_ulysses_on_a_2x2_mesh(outcomes, name):
    assert_ok(outcomes, f"mesh:{name}")


@pytest.mark.parametrize("name", MESH_FAMILIES)
def test_fsdp2_times_context_parallel_on_a_2x2_mesh(outcomes, name):
    """The second mesh dimension split by context parallelism instead of Ulysses (dp x cp)."""
    assert_ok(outcomes, f"mesh_cp:{name}")
