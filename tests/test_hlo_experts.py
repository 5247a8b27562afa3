"""fnscale.analysis.hlo on what a mixture of experts compiles to for a TPU: ragged all-to-alls
(sync, and async as MaxText's compiled Mixtral step holds them), SparseCore offloads (async
calls and async custom calls), and the grouped matmuls (ragged-dot, XLA's TPU kernels for
it, megablox). The snippets copy the spelling of libtpu's output for jax 0.10.2 (fnscale's
and MaxText 0.2.5's Mixtral steps compiled for v5p-8); each count is worked out by hand.
"""
from fnscale.analysis import hlo

_HEAD = "HloModule m, num_partitions=4\n\n"


def _entry(*lines: str) -> str:
  return (_HEAD + "ENTRY %main (p: f32[]) -> f32[] {\n" + "\n".join(f"  {l}" for l in lines)
          + "\n}\n")


def test_a_ragged_all_to_all_counts_the_smaller_of_what_it_sends_and_receives():
  # Dispatch: 512 copies x 256 (bf16, 262,144 B) sent into a worst-case buffer of 2048 rows
  # (1 MiB); combine: the buffer sent back into the 512 rows. Each moves 262,144 B at most,
  # 3/4 of it to the other 3 devices of its group.
  text = _entry(
      "%x = bf16[512,2,128]{2,1,0:T(2,128)(2,1)} parameter(0)",
      "%buf = bf16[2048,2,128]{2,1,0:T(2,128)(2,1)} parameter(1)",
      "%io = s32[4]{0:T(128)} parameter(2)",
      "%got = bf16[2048,2,128]{2,1,0:T(2,128)(2,1)} ragged-all-to-all(%x, %buf, %io, %io, "
      "%io, /*index=5*/%io), channel_id=1, replica_groups={{0,1,2,3}}",
      "%back = bf16[512,2,128]{2,1,0:T(2,128)(2,1)} ragged-all-to-all(%got, %x, %io, %io, "
      "%io, /*index=5*/%io), channel_id=1, replica_groups={{0,1,2,3}}",
      "ROOT %p = f32[] parameter(3)")
  s = hlo.summarize(text)
  assert s.unread.count == 0
  assert s.collective("ragged-all-to-all") == hlo.Collective(
      "ragged-all-to-all", 2, 2 * 262144, 2, 2 * 0.75 * 262144)
  assert s.groups == (("ragged-all-to-all", 4, 2 * 0.75 * 262144),)


def test_an_async_ragged_all_to_all_is_one_collective_at_its_done():
  # MaxText's spelling: the -start's tuple holds the operand (8192 copies x 4096 bf16 = 64 MiB)
  # and the buffer (32768 rows); the -done's result is the buffer. One run, 64 MiB, in a
  # loop of 2 trips: 2 runs.
  start = ("%s = ((bf16[8192,2,2048]{2,1,0:T(2,128)(2,1)}, bf16[32768,2,2048]{2,1,0}, "
           "s32[4]{0}, s32[4]{0}, s32[4]{0}, /*index=5*/s32[4]{0}), bf16[32768,2,2048]{2,1,0}, "
           "u32[]{:S(2)}, u32[]{:S(2)}) ragged-all-to-all-start(%x, %buf, %i, %i, %i, "
           "/*index=5*/%i), channel_id=1, replica_groups={{0,1,2,3}}")
  text = (_HEAD + "%body (t: (s32[])) -> (s32[]) {\n"
          "  %t = (s32[]) parameter(0)\n"
          "  %x = bf16[8192,2,2048]{2,1,0} parameter(1)\n"
          "  %buf = bf16[32768,2,2048]{2,1,0} parameter(2)\n"
          "  %i = s32[4]{0} parameter(3)\n"
          f"  {start}\n"
          "  %d = bf16[32768,2,2048]{2,1,0:T(2,128)(2,1)} ragged-all-to-all-done(%s)\n"
          "  ROOT %r = (s32[]) tuple(%t)\n}\n\n"
          "%cond (c: (s32[])) -> pred[] {\n  %c = (s32[]) parameter(0)\n"
          "  ROOT %lt = pred[] constant(true)\n}\n\n"
          "ENTRY %main (p: (s32[])) -> (s32[]) {\n  %p = (s32[]) parameter(0)\n"
          "  ROOT %w = (s32[]) while(%p), condition=%cond, body=%body, "
          'backend_config={"known_trip_count":{"n":"2"}}\n}\n')
  s = hlo.summarize(text)
  assert s.unread.count == 0
  mib64 = 8192 * 4096 * 2
  assert s.collective("ragged-all-to-all") == hlo.Collective(
      "ragged-all-to-all", 2, 2 * mib64, 1, 2 * 0.75 * mib64)


def test_sparsecore_offloads_are_read_through_the_computations_they_call():
  # A bincount's scatter-add offloaded as an async custom call (-start/-update/-done) and a
  # gather as an async call (call-start/-update/-done), each with its set-up custom calls: no work
  # of their own; the offloaded computations hold an all-reduce of s32[8] (32 B), read once
  # per start (not again at -update or -done).
  text = (_HEAD + "%offloaded (a: s32[8]) -> s32[8] {\n  %a = s32[8]{0} parameter(0)\n"
          "  ROOT %ar = s32[8]{0} all-reduce(%a), channel_id=2, replica_groups={{0,1,2,3}}, "
          "use_global_device_ids=true, to_apply=%add\n}\n\n"
          "%add (x: s32[], y: s32[]) -> s32[] {\n  %x = s32[] parameter(0)\n"
          "  %y = s32[] parameter(1)\n  ROOT %s = s32[] add(%x, %y)\n}\n\n"
          "ENTRY %main (p: s32[8]) -> s32[8] {\n  %p = s32[8]{0} parameter(0)\n"
          '  %prep = s32[]{:S(2)} custom-call(), custom_call_target="PrepareAsyncCallStart"\n'
          '  %tok = token[] custom-call(%prep), custom_call_target="PrepareAsyncCallDone"\n'
          "  %cs = ((), (), (s32[8]{0})) custom-call-start(), async_execution_thread="
          '"sparsecore", custom_call_target="TODO(b/522284627)", '
          "called_computations={%offloaded}\n"
          "  %cu = ((s32[8]{0}), s32[8]{0}, (s32[8]{0})) custom-call-update(%cs, %p)\n"
          "  %cd = s32[8]{0:T(128)} custom-call-done(%cu)\n"
          '  %as = ((s32[8]{0}), s32[8]{0}, u32[]{:S(8)}) call-start(%cd), async_execution_thread'
          '="sparsecore", to_apply=%offloaded\n'
          "  %au = ((s32[8]{0}), s32[8]{0}, u32[]{:S(8)}) call-update(%as)\n"  # libtpu, jax 0.12
          "  ROOT %ad = s32[8]{0} call-done(%au)\n}\n")
  s = hlo.summarize(text)
  assert s.unread.count == 0
  assert s.collective("all-reduce").count == 2 and s.collective("all-reduce").bytes == 64


def _kernel(name: str, flops: int) -> str:
  return (f"%{name} = bf16[2048,512]{{1,0}} custom-call(%a), "
          'custom_call_target="tpu_custom_call", backend_config={"custom_call_config":'
          f'{{"cost_estimate":{{"flops":"{flops}","transcendentals":"0"}}}}}}')


def test_grouped_matmul_flops_of_ragged_dots_and_their_kernels():
  # XLA's TPU kernels for ragged-dot (2 x 2048 x 256 x 512 = 536,870,912 declared each; the
  # metadata kernel computes no product), megablox's gmm and tgmm, and a ragged-dot op
  # (2 x 16 x 4 x 8 = 1,024, also a matmul): grouped FLOPs are all of them.
  mm = 2 * 2048 * 256 * 512
  text = _entry(
      "%a = bf16[2048,256]{1,0} parameter(0)",
      _kernel("ragged-dot-none.4", mm), _kernel("ragged-dot-none.5", mm),
      _kernel("ragged-dot-metadata", 7), _kernel("gmm.3", mm), _kernel("tgmm", mm // 2),
      _kernel("splash_mha_fwd", 99),
      "%l = f32[16,4]{1,0} parameter(1)",
      "%r = f32[2,4,8]{2,1,0} parameter(2)",
      "%g = s32[2]{0} parameter(3)",
      "%rd = f32[16,8]{1,0} ragged-dot(%l, %r, %g), lhs_contracting_dims={1}, "
      "rhs_contracting_dims={1}, lhs_ragged_dims={0}, rhs_group_dims={0}",
      "ROOT %p = f32[] parameter(4)")
  s = hlo.summarize(text)
  assert s.unread.count == 0
  assert s.grouped_flops == 3 * mm + mm // 2 + 1024
  assert s.matmul_flops == 1024  # kernels are listed, not counted as matmuls
  assert {k.name for k in s.kernels} >= {"ragged-dot-none", "gmm", "tgmm", "splash_mha_fwd"}
