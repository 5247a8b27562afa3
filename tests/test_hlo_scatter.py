"""Each collective form counted at the bytes a device sends for it, by hand on HLO text.

Ring algorithms (Thakur, Rabenseifner & Gropp, 2005, "Optimization of Collective
Communication Operations in MPICH"; Patarasuk & Yuan, 2009): over n devices an all-reduce
of S bytes sends 2 (n-1)/n S per device (a reduce-scatter then an all-gather), a
reduce-scatter or an all-gather (n-1)/n S. The TPU compiler writes a reduce-scatter as a
fusion (kind=kCustom, computation `all-reduce-scatter`, emitter
`SingleInputAllReduceScatterFusion` or `AllReduceScatterFusion`) whose computation returns
a dynamic-slice of an all-reduce: it is a reduce-scatter, (n-1)/n S, not the inner
all-reduce's 2 (n-1)/n S. The snippets copy libtpu's spelling (jax 0.10.2, libtpu 0.0.42.1,
a Llama step and an MLP step compiled for v5p-8 and v5p:2x2x2); the compiled programs are
counted in tests/test_accumulation.py.
"""
import pytest

from fnscale.analysis import hlo

_HEAD = "HloModule m, num_partitions=8\n\n"
_ADD = """%add.1 (x: bf16[], y: bf16[]) -> bf16[] {
  %x = bf16[] parameter(0)
  %y = bf16[] parameter(1)
  ROOT %a = bf16[] add(%x, %y)
}

"""
_GROUPS4 = "replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true"
# One bf16[4096,1024] gradient (8 MiB) reduced over groups of 4 devices, each keeping a
# [4096,256] shard (2 MiB).
_S, _SHARD = 4096 * 1024 * 2, 4096 * 256 * 2


def _fused(kind="kCustom", sizes="{4096,256}", shard="bf16[4096,256]", root_op="dynamic-slice"):
  """libtpu's fused reduce-scatter: a fusion calling all-reduce + dynamic-slice."""
  return _HEAD + _ADD + f"""%all-reduce-scatter.clone.1 (input.21: bf16[4096,1024]) -> {shard} {{
  %input.21 = bf16[4096,1024]{{1,0:T(8,128)(2,1)S(1)}} parameter(0)
  %all-reduce.60 = bf16[4096,1024]{{1,0:T(8,128)(2,1)}} all-reduce(%input.21), channel_id=33, \
{_GROUPS4}, to_apply=%add.1, frontend_attributes={{from-cross-replica-sharding="true"}}
  %constant.1020 = u32[] constant(0)
  %partition-id.47 = u32[] partition-id()
  %constant.1021 = u32[] constant(256)
  %multiply.185 = u32[]{{:T(128)}} multiply(%partition-id.47, %constant.1021)
  ROOT %dynamic-slice.147 = {shard}{{1,0:T(8,128)(2,1)}} {root_op}(%all-reduce.60, \
%constant.1020, %multiply.185), dynamic_slice_sizes={sizes}
}}

ENTRY %main (p: bf16[4096,1024]) -> {shard} {{
  %p = bf16[4096,1024]{{1,0}} parameter(0)
  ROOT %fusion.446 = {shard}{{1,0:T(8,128)(2,1)}} fusion(%p), kind={kind}, \
calls=%all-reduce-scatter.clone.1, backend_config={{"collective_algorithm_config":\
{{"emitter":"SingleInputAllReduceScatterFusion","strategy":"StrategySubgroupND"}}}}
}}
"""


def test_a_fused_all_reduce_scatter_is_a_reduce_scatter():
  s = hlo.summarize(_fused())
  # (n-1)/n S = 3/4 x 8 MiB = 6 MiB sent; its bytes are the 2 MiB shard it keeps.
  assert s.collective("reduce-scatter") == hlo.Collective("reduce-scatter", 1, _SHARD, 1,
                                                          3 / 4 * _S)
  assert s.collective("all-reduce").count == 0
  assert s.groups == (("reduce-scatter", 4, 3 / 4 * _S),)
  assert s.unread.count == 0


def test_an_all_reduce_then_a_slice_outside_a_fusion_stays_an_all_reduce():
  # libtpu runs a lone all-reduce with an all-reduce emitter, whole, and slices afterwards
  # (what it does for a reduce-scatter over a tile-misaligned minor dimension): 2 x 3/4 S.
  text = _HEAD + _ADD + f"""ENTRY %main (p: bf16[4096,1024]) -> bf16[4096,256] {{
  %p = bf16[4096,1024]{{1,0}} parameter(0)
  %ar = bf16[4096,1024]{{1,0}} all-reduce(%p), channel_id=2, {_GROUPS4}, to_apply=%add.1
  %c0 = u32[] constant(0)
  %pid = u32[] partition-id()
  ROOT %ds = bf16[4096,256]{{1,0}} dynamic-slice(%ar, %c0, %pid), dynamic_slice_sizes={{4096,256}}
}}
"""
  s = hlo.summarize(text)
  assert s.collective("all-reduce").bytes_sent == 2 * 3 / 4 * _S
  assert s.collective("reduce-scatter").count == 0


@pytest.mark.parametrize("sizes, shard", [("{4096,512}", "bf16[4096,512]"),
                                          ("{2048,256}", "bf16[2048,256]")])
def test_a_fused_slice_that_is_not_one_shard_of_n_stays_an_all_reduce(sizes, shard):
  # A slice of 1/2 or 1/8 of an array reduced over 4 devices is no reduce-scatter's shard:
  # the whole all-reduce is counted (an upper bound), 2 x 3/4 S.
  s = hlo.summarize(_fused(sizes=sizes, shard=shard))
  assert s.collective("all-reduce").bytes_sent == 2 * 3 / 4 * _S
  assert s.collective("reduce-scatter").count == 0


def test_a_fusion_returning_something_else_keeps_its_all_reduce():
  s = hlo.summarize(_fused(root_op="copy").replace(", dynamic_slice_sizes={4096,256}", "")
                    .replace("(%all-reduce.60, %constant.1020, %multiply.185)",
                             "(%all-reduce.60)").replace("bf16[4096,256]", "bf16[4096,1024]"))
  assert s.collective("all-reduce").bytes_sent == 2 * 3 / 4 * _S


def test_a_tuple_all_reduce_scatter_of_two_gradients():
  # AllReduceScatterFusion of w1 f32[256,512] and w2 f32[512,256] (512 KiB each) over
  # groups of 4, keeping [256,128] and [128,256]: one reduce-scatter of 1 MiB, 3/4 MiB sent,
  # inside a loop of 4 trips: 4 runs, 3 MiB.
  text = _HEAD + """%add.f (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %a = f32[] add(%x, %y)
}

%all-reduce-scatter.2 (input_0: f32[256,512], input_1: f32[512,256]) -> (f32[256,128], f32[128,256]) {
  %input_0 = f32[256,512]{1,0:T(8,128)} parameter(0)
  %input_1 = f32[512,256]{1,0:T(8,128)S(1)} parameter(1)
  %all-reduce.16 = (f32[256,512]{1,0:T(8,128)}, f32[512,256]{1,0:T(8,128)}) all-reduce(%input_0, %input_1), channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add.f
  %get-tuple-element.11 = f32[256,512]{1,0:T(8,128)} get-tuple-element(%all-reduce.16), index=0
  %get-tuple-element.12 = f32[512,256]{1,0:T(8,128)} get-tuple-element(%all-reduce.16), index=1
  %constant.51 = u32[] constant(0)
  %partition-id.5 = u32[] partition-id()
  %dynamic-slice.13 = f32[256,128]{1,0:T(8,128)} dynamic-slice(%get-tuple-element.11, %constant.51, %partition-id.5), dynamic_slice_sizes={256,128}
  %bitcast.1 = f32[512,256]{1,0:T(8,128)} bitcast(%get-tuple-element.12)
  %dynamic-slice.14 = f32[128,256]{1,0:T(8,128)} dynamic-slice(%bitcast.1, %partition-id.5, %constant.51), dynamic_slice_sizes={128,256}
  ROOT %tuple.3 = (f32[256,128]{1,0:T(8,128)}, f32[128,256]{1,0:T(8,128)}) tuple(%dynamic-slice.13, %dynamic-slice.14)
}

%body (p: (s32[], f32[256,512], f32[512,256])) -> (s32[], f32[256,512], f32[512,256]) {
  %p = (s32[], f32[256,512], f32[512,256]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %a = f32[256,512]{1,0} get-tuple-element(%p), index=1
  %b = f32[512,256]{1,0} get-tuple-element(%p), index=2
  %fusion.11 = (f32[256,128]{1,0:T(8,128)}, f32[128,256]{1,0:T(8,128)}) fusion(%a, %b), kind=kCustom, calls=%all-reduce-scatter.2, backend_config={"collective_algorithm_config":{"emitter":"AllReduceScatterFusion","strategy":"StrategyRing"}}
  ROOT %t = (s32[], f32[256,512], f32[512,256]) tuple(%i, %a, %b)
}

%cond (c: (s32[], f32[256,512], f32[512,256])) -> pred[] {
  %c = (s32[], f32[256,512], f32[512,256]) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (x: (s32[], f32[256,512], f32[512,256])) -> (s32[], f32[256,512], f32[512,256]) {
  %x = (s32[], f32[256,512], f32[512,256]) parameter(0)
  ROOT %w = (s32[], f32[256,512], f32[512,256]) while(%x), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
}
"""
  s = hlo.summarize(text)
  mib = 2**20
  assert s.collective("reduce-scatter") == hlo.Collective("reduce-scatter", 4, 4 * mib / 4, 1,
                                                          4 * 3 / 4 * mib)
  assert s.collective("all-reduce").count == 0
  assert s.unread.count == 0


def test_ring_bytes_of_each_form():
  # S = 1 MiB over n = 4: all-reduce 2 x 3/4 S; all-gather and reduce-scatter 3/4 S (a
  # reduce-scatter's result is its S/n shard).
  mib = 2**20
  assert hlo.ring_bytes_sent("all-reduce", mib, 4) == 1.5 * mib
  assert hlo.ring_bytes_sent("all-gather", mib, 4) == 0.75 * mib
  assert hlo.ring_bytes_sent("reduce-scatter", mib / 4, 4) == 0.75 * mib


def test_compare_maxtext_counts_both_sides_fused_reduce_scatters_as_reduce_scatters(tmp_path):
  # fnscale's side reduce-scatters an 8 MiB gradient over 4 devices in libtpu's fused form
  # (3/4 x 8 MiB = 6 MiB sent; read as an all-reduce it was 12 MiB), MaxText's side
  # all-gathers 8 MiB over 4 (6 MiB): the same bytes, 1.00x (2.00x when read as all-reduce).
  import json  # pylint: disable=import-outside-toplevel
  from recipes.bench import compare_maxtext as cm  # pylint: disable=import-outside-toplevel
  gather = _HEAD + f"""ENTRY %main (p: bf16[1024,1024]) -> bf16[4096,1024] {{
  %p = bf16[1024,1024]{{1,0}} parameter(0)
  ROOT %ag = bf16[4096,1024]{{1,0}} all-gather(%p), channel_id=1, {_GROUPS4}, dimensions={{0}}
}}
"""
  facts = dict(argument=2**30, temp=2**30, compile_seconds=1.0, compiler="jax, libtpu")
  for side, text in (("fnscale", _fused()), ("maxtext", gather)):
    (tmp_path / f"{side}.hlo.txt").write_text(text)
    (tmp_path / f"{side}.json").write_text(json.dumps(facts))
  sides = {s: cm.read_side(str(tmp_path), s) for s in cm.SIDES}
  assert sides["fnscale"]["collectives"] == {"reduce-scatter": (1, 3 / 4 * _S)}
  table = cm.table(sides)
  assert "| collective bytes sent (ring) | 6 MiB | 6 MiB | 1.00x |" in table
