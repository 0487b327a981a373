"""The router: stable user → instance, minimal movement on membership change, bounded load."""

from __future__ import annotations

from collections import Counter

import pytest

from relay_engine.core.router import AffinityRouter

USERS = [f"user-{i}" for i in range(100_000)]


@pytest.fixture(scope="module")
def base_routes():
    router = AffinityRouter([f"pool.{i}" for i in range(8)])
    return {u: router.route(u) for u in USERS}


def test_same_user_same_instance():
    a = AffinityRouter(["p.0", "p.1", "p.2"])
    b = AffinityRouter(["p.2", "p.0", "p.1"])  # order of membership does not matter
    assert all(a.route(u) == b.route(u) == a.route(u) for u in USERS[:1000])


def test_removing_one_instance_moves_only_its_users(base_routes):
    router = AffinityRouter([f"pool.{i}" for i in range(8) if i != 3])
    moved = [u for u in USERS if router.route(u) != base_routes[u]]
    assert all(base_routes[u] == "pool.3" for u in moved)
    # exactly pool.3's users move: every one of them, and about 1/8 of all
    assert len(moved) == sum(1 for u in USERS if base_routes[u] == "pool.3")
    assert 1 / 8 - 0.05 <= len(moved) / len(USERS) <= 1 / 8 + 0.05


def test_adding_one_instance_moves_about_one_in_n(base_routes):
    router = AffinityRouter([f"pool.{i}" for i in range(9)])
    moved = [u for u in USERS if router.route(u) != base_routes[u]]
    assert all(router.route(u) == "pool.8" for u in moved)
    assert 1 / 9 - 0.05 <= len(moved) / len(USERS) <= 1 / 9 + 0.05


def test_users_spread_evenly(base_routes):
    counts = Counter(base_routes.values())
    assert max(counts.values()) / min(counts.values()) < 1.1


def test_bounded_load_falls_back_when_the_first_choice_is_overloaded():
    router = AffinityRouter(["a", "b", "c", "d"], epsilon=0.25)
    user = "hot-user"
    first = router.route(user)
    loads = {name: 1.0 for name in router.instances}
    loads[first] = 100.0
    second = router.route(user, loads)
    assert second != first
    assert second == router.ranking(user)[1]
    assert router.route(user, {name: 1.0 for name in router.instances}) == first


def test_no_instances_is_a_clear_error():
    with pytest.raises(LookupError, match="no live instances"):
        AffinityRouter([]).route("u")


def test_weights_are_the_users_blake2b_keyed_by_the_instance():
    """The weight function is part of the contract: clients of different versions must route a user
    alike, or its pre-infer signal and ranking request part ways."""
    import hashlib

    router = AffinityRouter([f"p.{i}" for i in range(5)])
    for user in ("u1", "user-42", "ü"):
        for name in router.instances:
            salt = hashlib.blake2b(name.encode(), digest_size=32).digest()
            expected = int.from_bytes(hashlib.blake2b(user.encode(), digest_size=8, key=salt).digest(), "big")
            assert router._weights(user)[name] == expected


def test_a_remembered_route_is_the_heaviest_instance_again():
    router = AffinityRouter([f"p.{i}" for i in range(64)])
    users = [f"user-{i}" for i in range(300)]
    first = [router.route(u) for u in users]
    assert [router.route(u) for u in users] == first
    assert first == [router.ranking(u)[0] for u in users]


def test_a_remembered_ranking_is_the_computed_one_and_follows_the_instance_set():
    router = AffinityRouter(["a", "b", "c"])
    first = router.ranking("u1")
    assert router.ranking("u1") == first and sorted(first) == ["a", "b", "c"]
    router.set_instances(["a", "b", "c", "d"])
    assert sorted(router.ranking("u1")) == ["a", "b", "c", "d"]
    assert router.route("u1") == router.ranking("u1")[0]
