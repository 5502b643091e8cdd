"""A sharded save is checked whole before torch.distributed.checkpoint reads it (dit_accel.run.sharded), on
saves torch writes here in one process; the launched zero2/zero3 runs' saves meet the same attacks through
`--resume`, `--init-from`, sample and export in tests/test_train_fsdp.py."""

import os
import pickle
import shutil
import warnings

import pytest
import sharded_attacks as attacks
import torch

from dit_accel.errors import UserError
from dit_accel.run.sharded import check_sharded_save


def _save(folder, with_bytes: bool = True):
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(3)}}
    if with_bytes:  # what an FSDP2 optimizer save holds beside its tensors
        state["param_groups"] = [{"lr": 1e-3, "betas": (0.9, 0.999), "params": ["model.w", "model.b"]}]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(folder), no_dist=True)
    return folder


def _torch_reads(folder) -> None:
    """What torch.distributed.checkpoint itself does with the folder (what the check stands before)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    state = {
        "model": {"w": torch.empty(2, 3), "b": torch.empty(3)},
        "param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": ["", ""]}],
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        try:
            dcp.load(state, checkpoint_id=str(folder), no_dist=True)
        except (Exception, CheckpointException):
            pass  # the payload has run by then, or torch refused on its own


def test_a_save_torch_wrote_passes_with_its_index(tmp_path):
    metadata = check_sharded_save(_save(tmp_path / "save"))
    assert {"model.w", "model.b", "param_groups.0.lr"} <= set(metadata.state_dict_metadata)
    check_sharded_save(_save(tmp_path / "model", with_bytes=False), tensors_only=True)


@pytest.mark.parametrize("attack", sorted(attacks.ATTACKS))
def test_each_crafted_save_runs_code_in_torch_and_is_refused_here_in_one_line(tmp_path, attack):
    """The positive control first: torch, reading the crafted folder, runs the payload (or reads outside it);
    then the check refuses a second copy of it, and nothing runs."""
    control, crafted = tmp_path / "control", tmp_path / "crafted"
    _save(control)
    ran = tmp_path / "RAN"
    attacks.ATTACKS[attack](control, ran)
    if attack in ("bytes entry", "rank-local index"):
        _torch_reads(control)
        assert ran.exists(), "the attack is not real: torch did not run it"
    marker = tmp_path / "PWNED"
    _save(crafted)
    named = attacks.ATTACKS[attack](crafted, marker)
    with pytest.raises(UserError) as refusal:
        check_sharded_save(crafted)
    message = str(refusal.value)
    assert len(message.splitlines()) == 1 and named in message and "refused" in message, message
    assert not marker.exists()


def test_a_weight_declared_as_bytes_is_refused_in_a_models_save_even_as_plain_data(tmp_path):
    folder = _save(tmp_path / "model", with_bytes=False)
    marker = tmp_path / "PWNED"
    attacks.bytes_entry(folder, marker, fqn=attacks.first_tensor(folder))
    with pytest.raises(UserError, match=r"declares the weight 'model\.(w|b)' as pickled bytes"):
        check_sharded_save(folder, tensors_only=True)
    with pytest.raises(UserError, match=r"as more than plain data \(UnpicklingError"):
        check_sharded_save(folder)  # an optimizer's save may hold bytes, but plain data only
    assert not marker.exists()


def test_a_slice_past_its_file_a_link_and_a_transform_are_refused(tmp_path):
    folder = _save(tmp_path / "save")
    metadata = attacks._index(folder)
    record = next(iter(metadata.storage_data.values()))
    size = (folder / record.relative_path).stat().st_size
    record.offset = size - 1
    attacks._write_index(folder, metadata)
    with pytest.raises(UserError, match=rf"reads bytes {size - 1}-.* which holds {size}"):
        check_sharded_save(folder)

    linked = _save(tmp_path / "linked")
    shard = sorted(linked.glob("*.distcp"))[0]
    shutil.move(shard, tmp_path / "elsewhere.distcp")
    os.symlink(tmp_path / "elsewhere.distcp", shard)
    with pytest.raises(UserError, match=r"is not a plain file"):
        check_sharded_save(linked)

    transformed = _save(tmp_path / "transformed")
    metadata = attacks._index(transformed)
    next(iter(metadata.storage_data.values())).transform_descriptors = ["zstd"]
    attacks._write_index(transformed, metadata)
    with pytest.raises(UserError, match=r"asks torch to transform"):
        check_sharded_save(transformed)


def test_a_bytes_entry_that_is_a_tensor_subclass_or_object_is_not_plain_data(tmp_path):
    """Weights-only loading builds tensors too; an optimizer's param groups never hold one."""
    import io

    from torch.distributed.checkpoint.metadata import MetadataIndex

    folder = _save(tmp_path / "save")
    metadata = attacks._index(folder)
    shard = sorted(folder.glob("*.distcp"))[0]
    buffer = io.BytesIO()
    torch.save(torch.ones(2), buffer)
    offset = shard.stat().st_size
    with shard.open("ab") as handle:
        handle.write(buffer.getvalue())
    record = metadata.storage_data[MetadataIndex("param_groups.0.lr")]
    record.offset, record.length = offset, len(buffer.getvalue())
    attacks._write_index(folder, metadata)
    with pytest.raises(UserError, match=r"holds 'param_groups\.0\.lr' as a Tensor, not plain data"):
        check_sharded_save(folder)


def test_the_safe_unpickler_builds_a_real_index_and_refuses_any_other_global(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.randn(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)}, "lr": 1e-4}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(tmp_path / "save"), no_dist=True)
    metadata = check_sharded_save(tmp_path / "save")
    assert set(metadata.state_dict_metadata) == {"model.w", "model.b", "lr"}
    marker = tmp_path / "PWNED"
    (tmp_path / "save" / ".metadata").write_bytes(pickle.dumps(attacks.SystemPayload(marker)))
    with pytest.raises(UserError, match=r"\.metadata asks for posix\.system .*refused"):
        check_sharded_save(tmp_path / "save")
    assert not marker.exists()
