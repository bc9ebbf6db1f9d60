"""Upstream's `verl.utils.hdfs_io`: `exists`, `makedirs` and `copy` for local paths and `hdfs://`
ones (through the `hdfs dfs` command line). They are `verl.utils.fs`'s, which `copy_to_local` and
the checkpoint managers use too; a failing `hdfs dfs` command raises instead of returning False."""

from verl.utils.fs import copy, exists, makedirs

__all__ = ["copy", "exists", "makedirs"]
