"""fnscale.hlo.summarize on small hand-written HLO: the counts a reader must get exactly."""
import pytest

from fnscale import hlo

# Two dots (one with two contracting dims) and a reduce-scatter over groups of 4, no loop.
FLAT = """HloModule flat, replica_count=1, num_partitions=8

ENTRY %main (a: f32[4,6], b: f32[6,5], c: bf16[2,3,7], d: bf16[3,7,9]) -> f32[4,5] {
  %a = f32[4,6]{1,0} parameter(0)
  %b = f32[6,5]{1,0} parameter(1)
  %c = bf16[2,3,7]{2,1,0} parameter(2)
  %d = bf16[3,7,9]{2,1,0} parameter(3)
  %e = f32[4,5]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %f = bf16[2,9]{1,0} dot(%c, %d), lhs_contracting_dims={1,2}, rhs_contracting_dims={0,1}
  %g = f32[1,5]{1,0} reduce-scatter(%e), channel_id=1, replica_groups=[2,4]<=[8], \
dimensions={0}, to_apply=%add
  ROOT %r = f32[4,5]{1,0} copy(%e)
}
"""


def test_flat_module_counts_by_hand():
  s = hlo.summarize(FLAT)
  # 2 x result elements x contracted size: 2*4*5*6 and 2*2*9*(3*7).
  assert s.matmul_flops == 2 * 4 * 5 * 6 + 2 * 2 * 9 * 21 == 996
  assert s.matmul_flops_once == s.matmul_flops and s.loops == () and s.num_devices == 8
  (rs,) = s.collectives
  # Result f32[1,5] = 20 bytes; a ring reduce-scatter over 4 devices sends 3 shards.
  assert rs == hlo.Collective("reduce-scatter", 1, 20, 1, 60.0)
  assert s.unknown_trip_counts == 0


def test_missing_kind_is_an_exact_zero_entry():
  s = hlo.summarize(FLAT)
  assert s.collective("reduce-scatter").count == 1
  for kind in ("all-reduce", "all-gather", "all-to-all"):
    assert s.collective(kind) == hlo.Collective(kind, 0, 0, 0, 0.0)
  assert tuple(s.collective(kind)) == (kind, 0, 0, 0, 0.0)


def test_num_devices_from_the_header_or_the_argument():
  assert hlo.summarize("HloModule m, replica_count=2, num_partitions=4\n").num_devices == 8
  assert hlo.summarize("HloModule m\n").num_devices == 1
  assert hlo.summarize(FLAT, num_devices=3).num_devices == 3


@pytest.mark.parametrize("kind,n,expect", [
    ("all-reduce", 4, 2 * 3 / 4 * 100), ("all-gather", 4, 3 / 4 * 100),
    ("all-to-all", 5, 4 / 5 * 100), ("reduce-scatter", 4, 300.0),
    ("collective-permute", 2, 100.0), ("collective-broadcast", 8, 100.0),
    ("all-reduce", 1, 0.0), ("reduce-scatter", 0, 0.0)])
def test_ring_bytes_sent_by_hand(kind, n, expect):
  assert hlo.ring_bytes_sent(kind, 100, n) == pytest.approx(expect, rel=1e-12)
