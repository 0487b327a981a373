"""The local-disk tier: written off the ranking path, checksummed (a corrupt file is a miss, never a
wrong score), a full disk counted and never raised, its own TTL and byte budget. Real files in a
temporary directory throughout."""

from __future__ import annotations

import os
import threading
import time
import zlib

import pytest
import torch

from relay_engine.core import disk as disk_module
from relay_engine.core.config import parse_policy
from relay_engine.core.disk import _HEADER, MAGIC, DiskTier, encode
from relay_engine.core.dram import DRAMTier
from relay_engine.core.engine import RankRequest, RelayEngine
from relay_engine.core.kvcache import CacheKey, HBMCache
from relay_engine.core.model import History, PrefixKV
from relay_engine.core.outcomes import Outcome
from relay_engine.core.tiers import TierStack
from tests.models import SMALL, make_history

from .test_dram import all_at_once
from .test_kvcache import Clock, key
from .test_model import TOLERANCE, relative_error

CPU = torch.device("cpu")


def kv_of(n: int, seed: int = 0) -> PrefixKV:
    g = torch.Generator().manual_seed(seed)
    tail = History.from_lists([3], [1])
    return PrefixKV(torch.randn(2, 2, 2, n, 4, generator=g), torch.arange(n), n + 1, "v", "none", tail)


def file_bytes(kv: PrefixKV, i: int = 0) -> int:
    return len(encode(key(i), kv))


def written(tier: DiskTier, k: CacheKey) -> bytes:
    assert tier.flush(timeout_s=30)
    return tier.path_of(k).read_bytes()


def test_an_entry_comes_back_from_its_file_exactly(tmp_path):
    tier = DiskTier(tmp_path, 10**7, ttl_s=60)
    kv = kv_of(16)
    assert tier.admit(key(1), kv)
    assert written(tier, key(1))[:len(MAGIC)] == MAGIC
    back = tier.lookup(key(1))
    assert torch.equal(back.kv, kv.kv) and torch.equal(back.timestamps, kv.timestamps)
    assert torch.equal(back.tail.items, kv.tail.items) and back.length == kv.length
    assert key(1) not in tier and not tier.path_of(key(1)).exists()  # taken out: it moved up a tier
    assert tier.counters.hits == 1 and tier.used_bytes == 0


@pytest.mark.parametrize("damage", ["flip_payload_byte", "truncate", "bad_magic", "empty"])
def test_a_torn_or_corrupted_file_is_a_miss_and_is_counted(tmp_path, damage):
    tier = DiskTier(tmp_path, 10**7, ttl_s=60)
    tier.admit(key(1), kv_of(16))
    path = tier.path_of(key(1))
    data = bytearray(written(tier, key(1)))
    if damage == "flip_payload_byte":
        data[-10] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "bad_magic":
        data[0] ^= 0xFF
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    assert tier.lookup(key(1)) is None
    assert tier.counters.corrupt_reads == 1 and tier.counters.hits == 0
    assert not path.exists()


def test_a_file_holding_another_key_is_a_miss(tmp_path):
    tier = DiskTier(tmp_path, 10**7, ttl_s=60)
    tier.admit(key(1), kv_of(16, seed=1))
    tier.admit(key(2), kv_of(16, seed=2))
    assert tier.flush(timeout_s=30)
    os.replace(tier.path_of(key(2)), tier.path_of(key(1)))  # intact, checksummed, but key 2's entry
    assert tier.lookup(key(1)) is None
    assert tier.counters.corrupt_reads == 1


def test_a_view_into_a_larger_buffer_is_written_as_its_own_bytes(tmp_path):
    # A slice of a preallocated slab (the benchmark primes with views of one zero buffer): the file holds
    # the 16 tokens the entry has, not the 1024 of the storage under it.
    slab = torch.randn(2, 2, 2, 1024, 4)
    view = PrefixKV(slab[:, :, :, :16], torch.arange(16), 17, "v", "none", History.from_lists([3], [1]))
    tier = DiskTier(tmp_path, 10**7, ttl_s=60)
    assert tier.admit(key(1), view)
    assert len(written(tier, key(1))) == file_bytes(kv_of(16)) < slab.numel() * slab.element_size()
    back = tier.lookup(key(1))
    assert torch.equal(back.kv, view.kv) and back.kv.is_contiguous()


def test_a_layout_naming_a_dtype_not_allowed_is_a_miss_though_its_checksum_holds(tmp_path):
    tier = DiskTier(tmp_path, 10**7, ttl_s=60)
    tier.admit(key(1), kv_of(16))
    data = bytearray(written(tier, key(1)))
    at = data.index(b'"float32"')
    data[at:at + 9] = b'"Float32"'  # a name torch has no dtype for, not an attribute to look up
    magic, meta_len, payload_len, _ = _HEADER.unpack_from(data)
    _HEADER.pack_into(data, 0, magic, meta_len, payload_len, zlib.crc32(data[_HEADER.size:]))
    tier.path_of(key(1)).write_bytes(bytes(data))
    assert tier.lookup(key(1)) is None and tier.counters.corrupt_reads == 1


def test_the_writer_runs_at_the_lowest_cpu_priority(tmp_path, monkeypatch):
    seen, layout = [], disk_module._layout

    def recording(*args):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return layout(*args)

    monkeypatch.setattr(disk_module, "_layout", recording)
    tier = DiskTier(tmp_path, 10**7, ttl_s=60)
    tier.admit(key(1), kv_of(16))
    assert tier.flush(timeout_s=30)
    assert seen == [disk_module.WRITER_NICE] and os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == 0


def test_a_full_disk_is_counted_and_the_entry_dropped_without_raising(tmp_path):
    tier = DiskTier(tmp_path, 10**7, ttl_s=60)
    # The writer's temporary file is the kernel's always-full device: every write fails with ENOSPC.
    os.symlink("/dev/full", tier.path_of(key(1)).with_name(tier.path_of(key(1)).name + ".tmp"))
    assert tier.admit(key(1), kv_of(16))
    assert tier.flush(timeout_s=30)
    assert tier.counters.failed_writes == 1
    assert key(1) not in tier and tier.used_bytes == 0
    assert tier.lookup(key(1)) is None
    assert tier.admit(key(2), kv_of(16)) and tier.flush(timeout_s=30)  # the tier lives on
    assert tier.lookup(key(2)) is not None


def test_a_full_disk_under_the_stack_is_a_miss_on_the_ranking_path(tmp_path):
    kv = kv_of(16)
    disk = DiskTier(tmp_path, 10**7, ttl_s=60)
    stack = TierStack(HBMCache(kv.nbytes, 60), [DRAMTier(CPU, kv.nbytes, 60), disk], CPU)
    tmp = disk.path_of(key(1)).with_name(disk.path_of(key(1)).name + ".tmp")
    os.symlink("/dev/full", tmp)
    for i in (1, 2, 3):  # 1 goes HBM → DRAM → disk, where its write fails
        stack.insert(key(i), kv_of(16, seed=i), consumed=True)
    assert stack.flush(timeout_s=30)
    assert disk.counters.failed_writes == 1
    assert stack.lookup(key(1)).outcome is Outcome.MISS


def test_an_entry_past_its_ttl_is_a_miss_and_its_file_is_deleted(tmp_path):
    clock = Clock()
    tier = DiskTier(tmp_path, 10**7, ttl_s=5.0, clock=clock)
    tier.admit(key(1), kv_of(16))
    tier.admit(key(2), kv_of(16))
    assert tier.flush(timeout_s=30)
    clock.now = 6.0
    assert tier.lookup(key(1)) is None
    assert tier.expire() == 1  # key 2, by the periodic sweep
    assert tier.counters.expirations == 2
    assert list(tmp_path.iterdir()) == [] and tier.used_bytes == 0


def test_the_byte_budget_holds_and_the_oldest_file_goes_first(tmp_path):
    size = file_bytes(kv_of(16))
    tier = DiskTier(tmp_path, 2 * size + size // 2, ttl_s=60)
    for i in range(4):
        tier.admit(key(i), kv_of(16, seed=i))
        assert tier.flush(timeout_s=30)
        assert tier.used_bytes <= tier.budget_bytes
    assert [key(i) in tier for i in range(4)] == [False, False, True, True]
    assert tier.counters.evictions == 2
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) == tier.used_bytes == 2 * size
    tier.resize(size, ttl_s=60)
    assert len(tier) == 1 and tier.used_bytes == size


def test_an_entry_larger_than_the_budget_is_refused(tmp_path):
    tier = DiskTier(tmp_path, 100, ttl_s=60)
    assert not tier.admit(key(1), kv_of(16))
    assert tier.counters.rejected == 1 and list(tmp_path.iterdir()) == []


def test_files_of_an_earlier_run_are_deleted_at_start(tmp_path):
    first = DiskTier(tmp_path, 10**7, ttl_s=60)
    first.admit(key(1), kv_of(16))
    assert first.flush(timeout_s=30) and any(tmp_path.iterdir())
    DiskTier(tmp_path, 10**7, ttl_s=60)
    assert list(tmp_path.iterdir()) == []


def test_concurrent_ranks_promoting_one_disk_entry_read_it_once_and_count_once(tmp_path):
    disk = DiskTier(tmp_path, 10**7, ttl_s=60)
    stack = TierStack(HBMCache(10**7, 60), [DRAMTier(CPU, 10**7, 60), disk], CPU)
    disk.admit(key(7), kv_of(16))
    assert stack.flush(timeout_s=30)
    reads, real_lookup = [], disk.lookup

    def slow_lookup(k):
        reads.append(1)
        time.sleep(0.2)  # a read slow enough for every rank to pile up behind it
        return real_lookup(k)

    disk.lookup = slow_lookup
    results = all_at_once(8, lambda: stack.lookup(key(7)))
    assert len(reads) == 1 and disk.counters.hits == 1 and stack.promotions == 1
    assert sorted(r.outcome for r in results) == [Outcome.DISK] + [Outcome.INFLIGHT] * 7
    assert stack.dedup_reloads == 1 and stack.where(key(7)) is Outcome.HBM


# --- through the engine ---------------------------------------------------------------------------


def test_an_engine_with_a_disk_tier_ranks_exactly_from_it(tmp_path):
    per_prefix = SMALL.kv_bytes_per_token() * 200
    one = 1.5 * per_prefix / 2**20  # room for one prefix in HBM and one in DRAM
    engine = RelayEngine(SMALL, device="cpu", policy=parse_policy({"cache": {
        "hbm_budget_mb": one, "dram_budget_mb": one, "disk": {"path": str(tmp_path / "kv"), "budget_mb": 64}}}))
    short, cands = make_history(8, SMALL, seed=100), list(range(20))
    prefixes = [make_history(200, SMALL, seed=i) for i in range(3)]
    for i, prefix in enumerate(prefixes):
        assert engine.rank(RankRequest(f"u{i}", prefix, short, cands)).source is Outcome.MISS
    assert engine.cache.flush(timeout_s=30)
    assert engine.cache.where(engine.cache_key("u0", prefixes[0])) is Outcome.DISK
    result = engine.rank(RankRequest("u0", prefixes[0], short, cands))
    assert result.source is Outcome.DISK
    full = engine.model.rank_full(prefixes[0], short, cands)
    assert relative_error(torch.tensor(result.scores), full) <= TOLERANCE
    stats = engine.stats()
    assert stats.counters["disk_hits"] == 1 and stats.counters["misses"] == 3
    assert stats.tiers["disk"].counters.hits == 1 and stats.tiers["disk"].budget_bytes == 64 * 2**20
    engine.close()


def test_a_policy_without_the_disk_section_turns_the_tier_off_and_deletes_its_files(tmp_path):
    spec = {"cache": {"disk": {"path": str(tmp_path), "budget_mb": 1}}}
    engine = RelayEngine(SMALL, device="cpu", policy=parse_policy(spec))
    disk = engine.cache.tier(Outcome.DISK)
    disk.admit(key(1), kv_of(16))
    assert engine.cache.flush(timeout_s=30) and any(tmp_path.iterdir())
    engine.apply_policy(parse_policy({}))
    assert engine.cache.tier(Outcome.DISK) is None and "disk" not in engine.stats().tiers
    assert list(tmp_path.iterdir()) == []


def test_a_storage_less_stand_in_is_accounted_for_without_a_file(tmp_path):
    """The fleet simulator's KV (a meta tensor) runs the tier's budget and order, writing nothing."""
    tier = DiskTier(tmp_path, 4500, ttl_s=60)
    stand_in = PrefixKV(torch.empty(2, 2, 2, 16, 4, device="meta"), None, 16, "v", "none")
    for i in range(3):
        assert tier.admit(key(i), stand_in)
    assert tier.flush(timeout_s=30)
    assert list(tmp_path.iterdir()) == []
    assert [key(i) in tier for i in range(3)] == [False, True, True]  # 2048 bytes each, 4500 budget
    assert tier.lookup(key(2)) is stand_in and tier.counters.hits == 1


def test_an_entry_demoted_again_while_its_older_version_is_written_is_written_too(tmp_path):
    tier = DiskTier(tmp_path, 10**7, ttl_s=60)
    real_write, writing, release = tier._write_file, threading.Event(), threading.Event()

    def held_write(path, data):
        writing.set()
        assert release.wait(30)
        real_write(path, data)

    tier._write_file = held_write
    tier.admit(key(1), kv_of(16, seed=1))
    assert writing.wait(30)  # the first version is being written
    tier.admit(key(1), kv_of(16, seed=2))
    release.set()
    assert tier.flush(timeout_s=30)
    assert tier.path_of(key(1)).exists() and tier.used_bytes == len(tier.path_of(key(1)).read_bytes())
    assert torch.equal(tier.lookup(key(1)).kv, kv_of(16, seed=2).kv)


def test_a_closed_tier_takes_nothing_more(tmp_path):
    """A demotion racing the policy that removed the tier must not leave a file behind."""
    tier = DiskTier(tmp_path / "disk", 10**7, ttl_s=60)
    tier.close()
    assert not tier.admit(key(1), kv_of(16)) and tier.counters.rejected == 1
    assert tier.flush(timeout_s=30) and not (tmp_path / "disk").exists()


def test_demotions_past_the_writers_queue_limit_are_refused_not_held(tmp_path, monkeypatch):
    release = threading.Event()
    layout = disk_module._layout

    def stalled(*args):  # a writer that has fallen behind
        release.wait(30)
        return layout(*args)

    monkeypatch.setattr(disk_module, "_layout", stalled)
    monkeypatch.setattr(disk_module, "MAX_QUEUED_BYTES", 3 * kv_of(16).nbytes)
    tier = DiskTier(tmp_path, 10**7, ttl_s=60)
    assert [tier.admit(key(i), kv_of(16, seed=i)) for i in range(5)] == [True, True, True, False, False]
    assert tier.counters.rejected == 2
    release.set()
    assert tier.flush(timeout_s=30) and len(tier) == 3
