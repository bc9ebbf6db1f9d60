"""Which node each entry of a multi-node resource pool goes to (the pure part of placement; the
real two-node placement runs in tests/integration/test_multinode.py)."""

from __future__ import annotations

from verl.single_controller.ray.resource_pool import assign_nodes, bundles_that_fit, sort_placement_groups_by_node


def test_each_entry_gets_a_node_of_its_own_in_node_order():
    # Room for 4 bundles on every node: one entry per node even though two would fit on the first.
    assert assign_nodes([1, 1], [4, 4, 4]) == [0, 1]


def test_an_entry_skips_nodes_without_room():
    assert assign_nodes([2, 2], [1, 2, 3]) == [1, 2]


def test_largest_entry_is_placed_first_so_a_mixed_pool_fits():
    # In-order first fit would put 2 on node 0 (room 8) and leave no node for 8.
    assert assign_nodes([2, 8], [8, 2]) == [1, 0]


def test_a_missing_node_leaves_the_last_entry_unplaced():
    assert assign_nodes([1, 1, 1], [2, 2]) == [0, 1, None]
    assert assign_nodes([1], []) == [None]


def test_bundles_that_fit_counts_the_scarcest_resource():
    assert bundles_that_fit({"CPU": 3.0, "GPU": 8.0}, {"CPU": 1, "GPU": 1}) == 3
    assert bundles_that_fit({"CPU": 3.5}, {"CPU": 1}) == 3
    assert bundles_that_fit({"CPU": 16.0}, {"CPU": 1, "GPU": 1}) == 0


def test_nodes_sharing_an_ip_are_ordered_by_node_id():
    # Two Ray nodes on one machine: the node id breaks the tie, the same way every time.
    items = [("10.0.0.1", "ff01"), ("10.0.0.1", "0a02"), ("10.0.0.0", "zz")]
    assert sort_placement_groups_by_node(items) == [2, 1, 0]


def test_entries_without_free_room_fall_back_to_nodes_big_enough_to_wait_on():
    # Node 1 is free now; nodes 0 and 2 are busy but could hold 2 bundles: the leftover entry waits
    # on the first of them instead of failing.
    assert assign_nodes([2, 2], [0, 2, 0], fallback=[2, 2, 2]) == [1, 0]
    # No node is big enough for 4: that entry stays unplaced.
    assert assign_nodes([4, 1], [1, 1], fallback=[2, 2]) == [None, 0]


def test_ipv6_and_ipv4_nodes_sort_without_comparing_across_kinds():
    items = [("fe80::2", "a"), ("10.0.0.1", "b"), ("fe80::1", "c")]
    assert sort_placement_groups_by_node(items) == [1, 2, 0]
