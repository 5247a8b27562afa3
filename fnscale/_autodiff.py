"""Every derivative, in every mode, through kernels that define only a reverse-mode rule.

The kernels `fnscale.with_kernel` and the expert layer can select (splash and Pallas GPU
attention, cuDNN attention, the ring form of context attention, the blockwise
cross-entropy, megablox grouped matmuls, the expert exchange's sends and permutations)
differentiate by a `jax.custom_vjp`: the backward pass that makes them fast. jax can't push
a tangent forward through a custom_vjp (`jax.jvp`, `jax.linearize`, `jax.jacfwd`), nor
through the Pallas calls of its forward and backward passes (forward over reverse:
Hessian-vector products, `jax.hessian`).

`reverse_only(kernel, reference)` gives the kernel a `jax.custom_jvp` whose rule returns
the kernel's value and, as its tangent, one linear map that jax

- evaluates (`jax.jvp`, `jax.linearize`, `jax.jacfwd`) as the reference's JVP, and
- transposes (`jax.grad`, `jax.vjp`, `jax.jacrev`) by the kernel's own backward pass.

Which of the two happens is jax's decision, made when it evaluates or transposes the map,
not the rule's: a rule can't tell the mode where jax traces it on its own (inside a
`jax.jit`, `lax.scan` or `jax.checkpoint` differentiated from outside), so any choice made
there is wrong for one of them. The kernel's forward pass (value and residuals), the map
and the backward pass are each one primitive (`_compat.kernel_call`) whose own JVP is the
reference's, so differentiating them again (forward over reverse, reverse over reverse)
takes the reference's derivatives wherever jax meets them, also after it has hoisted a
scan's loop-invariant work (where it drops a custom_jvp's rule). The residuals are
functions of the arguments, so those derivatives follow the arguments' tangents alone.

Reverse mode runs exactly the kernel's forward and backward passes and saves no more than
they do; forward mode runs the kernel's forward pass for the value and the reference's
JVP for the tangent, and says so once per kernel in the log.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
import contextlib
import functools

from absl import logging
import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero, zero_from_primal

from fnscale import _compat


@functools.lru_cache(maxsize=None)
def _say(label: str) -> None:
  # Cached only so that each kernel is named once; it holds no decision.
  logging.warning("%s defines only a reverse-mode derivative (custom_vjp); forward-mode "
                  "autodiff (jax.jvp, linearize, jacfwd, Hessian-vector products) through "
                  "it uses %s", *label.split("|", 1))


def _live(tangents) -> list[int]:
  """Indices of the tangents a custom_jvp rule got that are not symbolic zeros."""
  return [i for i, t in enumerate(tangents) if not isinstance(t, SymbolicZero)]


def _jvp_in(fn: Callable, args: Sequence, tangents: Sequence) -> list:
  """The tangent leaves of `fn(*args)` for `tangents` (symbolic zeros left out)."""
  live = _live(tangents)

  def of_live(*xs):
    full = list(args)
    for i, x in zip(live, xs):
      full[i] = x
    return jax.tree.leaves(fn(*full))
  return jax.jvp(of_live, [args[i] for i in live], [tangents[i] for i in live])[1]


def _vjp_in(fn: Callable, args: Sequence, live: Sequence[int], cotangent) -> list:
  """The cotangents of `args[i]`, i in `live`, of `fn(*args)` for `cotangent`."""
  def of_live(*xs):
    full = list(args)
    for i, x in zip(live, xs):
      full[i] = x
    return fn(*full)
  return list(jax.vjp(of_live, *[args[i] for i in live])[1](cotangent))


def _kernel_precision(leaves):
  """Where a kernel's passes are traced: at jax's default matmul precision when an argument
  is a float narrower than 32 bits, whatever `jax.default_matmul_precision` the caller set.
  Mosaic can't lower a "highest" dot of bfloat16 operands ("Bad lhs type"), and the
  product of two bfloat16 values is exact in the float32 accumulator, so the setting asks
  nothing of such a dot; float32 kernels keep the caller's precision."""
  half = any(jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32
             for x in leaves if hasattr(x, "dtype"))
  return jax.default_matmul_precision(None) if half else contextlib.nullcontext()


def _kernel_forward(run: Callable, reference: Callable, primals: Sequence, kernels: bool):
  """(value, residual leaves, a thunk giving the residuals' tree) of the kernel's forward
  pass at `primals`, differentiable: the value's tangent is the reference's, the
  residuals' is zero (they are functions of the arguments, whose tangents the backward
  pass's own derivative follows). Only residuals the pass computes leave the primitive: one
  that is an argument or the value is taken from those (else a scan would save it twice)
  and a constant is kept as it is, so that under `jax.checkpoint` a policy saving what the
  kernel names (`_compat.kernel_call`) spares its rerun."""
  found = []  # (value's tree, residuals' tree, where each residual comes from), per trace

  def forward(*xs):
    with _kernel_precision(xs):
      y, pullback = jax.vjp(run, *xs)
    residuals, tree = jax.tree.flatten(pullback)
    y_leaves, y_tree = jax.tree.flatten(y)
    source = [_source(r, xs, y_leaves) for r in residuals]
    found.append((y_tree, tree, source))
    return [*y_leaves, *(r for r, s in zip(residuals, source) if s is None)]

  def jvp(xs, ts):  # the residuals' tangents: None (zero)
    return _jvp_in(reference, xs, ts) + [None] * found[-1][2].count(None)

  out = _compat.kernel_call(forward, list(primals), jvp=jvp, kernels=kernels)
  y_tree, tree, source = found[-1]
  y_leaves, own = out[:y_tree.num_leaves], iter(out[y_tree.num_leaves:])
  picks = {"arg": primals, "value": y_leaves}
  residuals = [next(own) if s is None else picks[s[0]][s[1]] if s[0] in picks else s[1]
               for s in source]
  return jax.tree.unflatten(y_tree, y_leaves), residuals, lambda: found[-1][1]


def _source(r, xs, y_leaves):
  """Where a residual comes from: ("arg", i), ("value", i), ("const", r) for one that is
  no traced value, None for one the pass computes."""
  for kind, leaves in (("arg", xs), ("value", y_leaves)):
    i = next((i for i, x in enumerate(leaves) if r is x), None)
    if i is not None:
      return kind, i
  return None if isinstance(r, jax.core.Tracer) else ("const", r)


def _kernel_backward(reference: Callable, live: Sequence[int], n: int, r: int,
                     tree: Callable, y_tree, kernels: bool) -> Callable:
  """`(*primals, *residuals, *cotangent leaves) -> live primals' cotangents` by the
  kernel's backward pass, differentiable: its tangent is that of the reference's VJP
  (in the primals and the cotangent; the residuals follow the primals)."""
  def backward(*a):
    with _kernel_precision(a[:n]):  # the kernel's backward pass is traced here
      grads = jax.tree.unflatten(tree(), a[n:n + r])(jax.tree.unflatten(y_tree, a[n + r:]))
    return [grads[i] for i in live]

  def reference_vjp(*a):
    return _vjp_in(reference, a[:n], live, jax.tree.unflatten(y_tree, a[n + r:]))

  def jvp(a, ts):
    return _jvp_in(reference_vjp, a, [t if not n <= i < n + r else
                                      zero_from_primal(x, symbolic_zeros=True)
                                      for i, (x, t) in enumerate(zip(a, ts))])

  return lambda *a: _compat.kernel_call(backward, list(a), jvp=jvp, kernels=kernels)


def _same_varying_axes(leaves: list) -> list:
  """The float arguments typed as varying over every manual axis one of them varies over
  (inside a shard_map that checks them), as jax types the operands of one of its own
  operations: the kernel's results and gradients vary over all of those, and jax's
  transpose of that cast reduces an argument's gradient over the axes it did not vary
  over. Integer arguments (ids, sizes) take no gradient and keep their types."""
  axes = set().union(*(_compat.varying_axes(x) for x in leaves))
  return [jax.lax.pcast(x, tuple(sorted(axes - _compat.varying_axes(x))), to="varying")
          if jnp.issubdtype(x.dtype, jnp.inexact) else x for x in leaves]


def reverse_only(kernel: Callable, reference: Callable, name: str, reference_name: str, *,
                 kernels: bool = True) -> Callable:
  """`kernel` with every derivative: `kernel(*args)`'s value, its own backward pass in
  reverse mode, and `reference`'s derivatives wherever a tangent is pushed forward (see
  the module docstring). `reference` computes the same function of the same arguments
  (arrays, None, pytrees). `name` and `reference_name` are what the one log line calls
  them. `kernels=False`: its passes are traced with their arguments' varying types, as a
  checked shard_map inside them must be (a Pallas call inside then needs a kernel_call of
  its own; `_compat.kernel_call`)."""
  label = f"{name}|{reference_name}"

  def call(*args):
    leaves, tree = jax.tree.flatten(args)
    leaves = _same_varying_axes(leaves)
    run = lambda *xs: kernel(*jax.tree.unflatten(tree, xs))
    ref = lambda *xs: reference(*jax.tree.unflatten(tree, xs))

    def value(*xs):  # the kernel alone, as a primitive too (see _compat.kernel_call)
      trees = []

      def flat(*a):
        with _kernel_precision(a):
          y = run(*a)
        trees.append(jax.tree.structure(y))
        return jax.tree.leaves(y)
      out = _compat.kernel_call(flat, list(xs), jvp=lambda a, ts: _jvp_in(ref, a, ts),
                                kernels=kernels)
      return jax.tree.unflatten(trees[-1], out)

    f = jax.custom_jvp(value)
    f.defjvp(functools.partial(_rule, run, ref, label, kernels), symbolic_zeros=True)
    return f(*leaves)

  return call


def _rule(run: Callable, ref: Callable, label: str, kernels: bool, primals, tangents):
  """The custom_jvp rule of `reverse_only`: the kernel's value, and its tangent as one
  linear map that jax evaluates by the reference and transposes by the kernel."""
  live, n = _live(tangents), len(primals)
  y, residuals, tree = _kernel_forward(run, ref, primals, kernels)
  y_tree, r = jax.tree.structure(y), len(residuals)

  def forward(*a):  # (*primals, *residuals, *live tangents) -> the output's tangent leaves
    return _jvp_in(ref, a[:n], [a[n + r + live.index(i)] if i in live else
                                zero_from_primal(a[i], symbolic_zeros=True)
                                for i in range(n)])

  backward = _kernel_backward(ref, live, n, r, tree, y_tree, kernels)
  t_y = _compat.kernel_call(forward, [*primals, *residuals, *(tangents[i] for i in live)],
                            transpose=backward, fixed=n + r,
                            on_evaluate=functools.partial(_say, label), kernels=False)
  # An integer output's tangent: a symbolic zero of its type (the map's float0 leaf is
  # typed as varying over no manual axis, whatever the output varies over).
  t_y = [t if jnp.issubdtype(v.dtype, jnp.inexact) else
         zero_from_primal(v, symbolic_zeros=True) for v, t in zip(jax.tree.leaves(y), t_y)]
  return y, jax.tree.unflatten(y_tree, t_y)
