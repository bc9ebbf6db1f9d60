"""FSDP + Ulysses sequence parallelism for a legacy worker's RPC bodies.

A worker's device mesh is ('dp', 'sp'): the data-parallel dispatch hands each rank its own chunk,
but the ranks of one sequence-parallel group must run the same rows (each takes a slice of every
sequence). So, around an RPC body:

* entering makes the mesh's 'sp' group the Ulysses group that `verl.utils.ulysses`'s functions use
  when given none (several models of one worker may have different meshes), leaving restores the
  previous one;
* `preprocess_data` all-gathers the input over the sp group (every rank of the group then holds the
  group's rows, in sp-rank order), in place;
* `postprocess_data` keeps this rank's share of the output: the sp-rank-th of sp-size equal chunks,
  i.e. the rows it was dispatched.

Without a mesh (`device_mesh=None`: no sequence parallelism) all three do nothing.
"""

from __future__ import annotations

from verl.protocol import DataProto, all_gather_data_proto
from verl.utils.ulysses import get_ulysses_sequence_parallel_group, set_ulysses_sequence_parallel_group
from verl.workers.sharding_manager.base import BaseShardingManager


class FSDPUlyssesShardingManager(BaseShardingManager):
    """`device_mesh`: a DeviceMesh with an 'sp' dimension, or None."""

    def __init__(self, device_mesh):
        super().__init__()
        self.device_mesh = device_mesh
        self.seed_offset = 12345  # upstream's public attribute, kept for code that reads it
        self.prev_sp_group = None

    def __enter__(self):
        if self.device_mesh is not None:
            self.prev_sp_group = get_ulysses_sequence_parallel_group()
            set_ulysses_sequence_parallel_group(self.device_mesh["sp"].get_group())

    def __exit__(self, exc_type, exc_value, traceback):
        if self.device_mesh is not None:
            set_ulysses_sequence_parallel_group(self.prev_sp_group)

    def preprocess_data(self, data: DataProto) -> DataProto:
        """All-gather `data` over the sp group, in place (and return it)."""
        if self.device_mesh is not None:
            all_gather_data_proto(data=data, process_group=self.device_mesh["sp"].get_group())
        return data

    def postprocess_data(self, data: DataProto) -> DataProto:
        """This rank's chunk of `data` (the sp-rank-th of sp-size equal chunks)."""
        if self.device_mesh is not None:
            sp = self.device_mesh["sp"]
            data = data.chunk(chunks=sp.size())[sp.get_local_rank()]
        return data
