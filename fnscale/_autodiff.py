"""Forward-mode autodiff through kernels that define only a reverse-mode rule.

The kernels `fnscale.with_kernel` and the expert layer can select (splash and Pallas GPU
attention, cuDNN attention, the ring form of context attention, the blockwise
cross-entropy, megablox grouped matmuls, the expert exchange's sends and permutations)
differentiate by a `jax.custom_vjp`: the backward pass that makes them fast. jax can't push
a tangent forward through a custom_vjp (`jax.jvp`, `jax.jacfwd`, Hessian-vector products:
forward over reverse), so where a call's arguments carry a tangent pushed forward from
outside (`_compat.pushes_forward`) `reverse_only` wraps the kernel in a `jax.custom_jvp`
whose rule takes the kernel's own derivative when jax is linearizing for a transpose
(reverse mode) and the JVP of a reference (the XLA form, or the kernel's forward
computation without its custom_vjp) when it is pushing tangents forward, and says so once
per kernel. Elsewhere the kernel runs as it is: a custom_jvp around its custom_vjp costs
reverse mode memory (it doubled the blockwise cross-entropy's temporaries).

jax traces a rule on its own inside a `lax.scan`, a `jax.checkpoint` or a jitted function
differentiated from outside (`jax.jvp(jax.jit(f))`), before it knows which mode will use
it; there the rule keeps the kernel (reverse mode, the training path, stays fast), and
forward mode raises jax's own error ("can't apply forward-mode autodiff (jvp) to a
custom_vjp function"). Its fix: choose the XLA reference for that computation
(`fnscale.with_kernel(fn, attention="xla")`), or take the jvp inside the jit.
"""
from __future__ import annotations

from collections.abc import Callable
import functools

from absl import logging
import jax
from jax.custom_derivatives import SymbolicZero

from fnscale import _compat


@functools.lru_cache(maxsize=None)
def _say(name: str) -> None:
  # Cached only so that each kernel is named once; it holds no decision.
  logging.warning("%s defines only a reverse-mode derivative (custom_vjp); forward-mode "
                  "autodiff (jax.jvp, jacfwd, Hessian-vector products) through it uses %s",
                  *name.split("|", 1))


def reverse_only(kernel: Callable, reference: Callable, name: str, reference_name: str
                 ) -> Callable:
  """`kernel` with forward-mode autodiff: `kernel(*args)`'s value, its own reverse-mode
  derivative, and `reference`'s JVP (`reference` computes the same function; any
  arguments: arrays, None, pytrees) when tangents are pushed forward (see the module
  docstring). `name` and `reference_name` are what the one log line calls them."""

  def call(*args):
    if not _compat.pushes_forward(args):
      # No tangent pushed forward from outside: the kernel as it is. (A custom_jvp around
      # its custom_vjp would cost reverse mode memory: the blockwise cross-entropy's
      # compiled temporaries doubled under one.)
      return kernel(*args)
    leaves, tree = jax.tree.flatten(args)
    run = lambda *xs: kernel(*jax.tree.unflatten(tree, xs))
    ref = lambda *xs: reference(*jax.tree.unflatten(tree, xs))
    f = jax.custom_jvp(run)

    def rule(primals, tangents):
      live = [i for i, t in enumerate(tangents) if not isinstance(t, SymbolicZero)]
      forward = _compat.forward_mode(primals, [tangents[i] for i in live])
      if forward:
        _say(f"{name}|{reference_name}")
      use = ref if forward else run

      def of_live(*xs):  # the function of the arguments that carry a tangent
        full = list(primals)
        for i, x in zip(live, xs):
          full[i] = x
        return use(*full)
      return jax.jvp(of_live, tuple(primals[i] for i in live),
                     tuple(tangents[i] for i in live))

    f.defjvp(rule, symbolic_zeros=True)
    return f(*leaves)

  return call
