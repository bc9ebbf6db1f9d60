"""DataProto: the one data container that flows between the driver and the workers.

A `DataProto` is three things that share a leading batch dimension of length N:

- `batch`: a `tensordict.TensorDict` of tensors with `batch_size=[N]` (or `None` for a proto that
  carries only non-tensor data),
- `non_tensor_batch`: a dict of numpy arrays (normally `dtype=object`) of length N, for strings,
  dicts and other per-sample Python objects (`uid`, `data_source`, `reward_model`, ...),
- `meta_info`: a plain dict of per-batch values (`temperature`, `eos_token_id`, `metrics`, ...).

The public API follows upstream verl so its users' code works unchanged. Design decisions:

- Cheap on the hot path. The single controller chunks a proto before every data-parallel RPC and
  concatenates the results after it, so every row operation works per key on whole tensors
  (one concatenation or gather per key, slicing into views) and per key on whole numpy arrays
  (`np.concatenate`, fancy indexing); there is no per-row Python loop for tensors. `repeat`,
  `reorder`, `select_idxs` and padding are all one gather with a computed index. CPU tensors are
  concatenated and gathered on one thread, by numpy: torch's intra-op threads cost milliseconds to
  wake on a busy machine, far more than the copy itself (see `_cat_rows`).
- Pickling is ours, not tensordict's. torch pickles a view together with its whole storage, so
  a chunk of a 64 MB batch would ship 64 MB to each worker. `__reduce_ex__` instead writes each
  tensor as one flat, contiguous byte buffer covering exactly its own elements (any dtype,
  bfloat16 included), next to its dtype name and shape: pickle writes it as one block, and Ray
  moves it out-of-band into its object store without an intermediate copy (measured in
  benchmarks/bench_protocol.py).
  Unpickled tensors are always on the CPU (the driver may have no accelerator); call `.to()` on
  the receiving side.
- Derived protos (slices, chunks, selections) get a shallow copy of `meta_info`, so setting a key
  on a chunk never leaks into its parent; slices and chunks share tensor storage with the parent.
- `concat` merges `meta_info`: equal values are kept, `metrics` (a dict of name -> value or list
  of values, or a list of such dicts) become one dict of flat lists across all parts (so a mean
  over a list is the mean over all ranks), `timing` (name -> seconds) keeps the maximum (parallel
  ranks finish when the slowest does), and any other key whose values differ is an error.
- Ray is imported only inside `DataProtoFuture` methods; importing this module never imports ray.
- Auto-padding (upstream's `DataProtoConfig.auto_padding`, the `VERL_AUTO_PADDING` variable, or
  `from_dict(..., auto_padding=True)` for one proto) lets `chunk` split a length that does not
  divide evenly: chunks of ceil(n / chunks) rows, the last ones shorter (possibly empty). The
  worker group's DataProto dispatch modes pad every batch anyway (see `single_controller`), so this
  only changes a direct `chunk` call.
- A proto has exactly one batch dimension; `fold_batch_dim` / `unfold_batch_dim` reshape the rows
  (e.g. [n * k, ...] <-> [n, k, ...]) while keeping that invariant.
- Refused input raises `DataProtoError` with a message saying what, why and how to fix it. It is a
  `ValueError` and also an `AssertionError`, because upstream checks the same preconditions with
  `assert` and its users' code (and tests) catch AssertionError.
- Layout. `verl.protocol` is a package whose `__init__` is the whole public surface (every name
  importable from it is listed in `__all__`, plus `_borrow_buffers` for the worker group); the
  code lives in private modules, one concern each, so none passes ~800 lines: `_columns`
  (column equality and union, meta_info merging, row gathers), `_wire` (pickling and upstream's
  `serialize_*`), `_data_proto` (the class) and `_ops` (fold/pad/`DataProtoFuture`). A package,
  not a `protocol.py` facade over a sibling `_protocol/` folder, so the implementation sits under
  the one name users import and nothing else appears in `verl/`. The public classes and
  `_rebuild_data_proto` report `__module__ == "verl.protocol"`, so pickles name the stable path
  (a proto saved with `save_to_disk` before the split still loads, and one saved now does not
  depend on the private module names).
"""

from verl.protocol._columns import (
    DataProtoConfig,
    DataProtoError,
    DataProtoKeyError,
    list_of_dict_to_dict_of_list,
    union_numpy_dict,
    union_tensor_dict,
)
from verl.protocol._data_proto import DataProto, DataProtoItem, _rebuild_data_proto, collate_fn
from verl.protocol._ops import (
    DataProtoFuture,
    all_gather_data_proto,
    fold_batch_dim,
    pad_dataproto_to_divisor,
    unfold_batch_dim,
    unpad_dataproto,
)

# Private, but imported by the worker group (borrowing buffers while it unpickles) and its tests.
from verl.protocol._wire import _borrow_buffers as _borrow_buffers
from verl.protocol._wire import _borrowing as _borrowing
from verl.protocol._wire import (
    deserialize_single_tensor,
    deserialize_tensordict,
    serialize_single_tensor,
    serialize_tensordict,
)

__all__ = [
    "DataProto",
    "DataProtoConfig",
    "DataProtoError",
    "DataProtoFuture",
    "DataProtoItem",
    "all_gather_data_proto",
    "collate_fn",
    "deserialize_single_tensor",
    "deserialize_tensordict",
    "fold_batch_dim",
    "list_of_dict_to_dict_of_list",
    "pad_dataproto_to_divisor",
    "serialize_single_tensor",
    "serialize_tensordict",
    "unfold_batch_dim",
    "union_numpy_dict",
    "union_tensor_dict",
    "unpad_dataproto",
]

# Pickle records a class or function by module and name: the stable public path, not the private module.
for _obj in (
    DataProto,
    DataProtoItem,
    DataProtoConfig,
    DataProtoError,
    DataProtoFuture,
    DataProtoKeyError,
    _rebuild_data_proto,
):
    _obj.__module__ = __name__
del _obj
