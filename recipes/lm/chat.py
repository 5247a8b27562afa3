"""Chat fine-tuning data: a conversation rendered with the tokenizer's chat template, loss
weight 1 on exactly the assistant turns.

The template is the Jinja text of a Hugging Face tokenizer (`tokenizer_config.json`'s
`chat_template`, or a `chat_template.jinja` beside it), rendered as transformers renders it
(a sandboxed Jinja environment with `trim_blocks`, `lstrip_blocks`, loop controls, `tojson`,
`raise_exception` and the tokenizer's special tokens as variables). An assistant turn is the
text the template adds between the conversation before it, rendered with the generation
prompt, and the conversation up to and including it: what the model must write after the
prompt at inference, its end-of-turn marker included. The text between assistant turns
(system, user, tool turns and the template's headers) has weight 0. Each piece is tokenized
on its own, so an assistant turn's first token is the one the model generates first after
the prompt (no token straddles a boundary).

Errors are `shards.ShardError` naming the conversation; `cache.py` makes them fnscale errors.
"""
from __future__ import annotations

import functools
import json
import os
from typing import NamedTuple

import numpy as np

from recipes.lm import shards


class Template(NamedTuple):
  """A chat template's Jinja text and the variables it reads (bos_token, eos_token, ...)."""
  text: str
  variables: tuple[tuple[str, str], ...] = ()


def load_template(tokenizer_spec: str, template_file: str = "") -> Template:
  """The chat template of a tokenizer: `template_file` if given (Jinja text), else
  tokenizer_config.json's `chat_template` (or chat_template.jinja) in the tokenizer's
  directory; its special tokens as variables.

  Raises:
    ShardError: no template found (naming where it looked and the fix).
  """
  base = tokenizer_spec if os.path.isdir(tokenizer_spec) else os.path.dirname(tokenizer_spec)
  config = {}
  cfg_path = os.path.join(base, "tokenizer_config.json")
  if tokenizer_spec == shards.BYTES:  # no tokenizer files: the template file alone
    cfg_path = base = os.devnull
  if os.path.isfile(cfg_path):
    with open(cfg_path) as f:
      config = json.load(f)
  text = config.get("chat_template") or ""
  if isinstance(text, list):  # named templates: the default one
    text = next((t["template"] for t in text if t.get("name") == "default"), "")
  jinja_path = os.path.join(base, "chat_template.jinja")
  if template_file:
    with open(template_file) as f:
      text = f.read()
  elif not text and os.path.isfile(jinja_path):
    with open(jinja_path) as f:
      text = f.read()
  if not text:
    raise shards.ShardError(
        f"tokenizer={tokenizer_spec!r} has no chat template (looked for chat_template in "
        f"{cfg_path} and {jinja_path}); fix: --chat_template=FILE (Jinja text) or a tokenizer "
        "directory whose tokenizer_config.json has one")
  special = {k: (v["content"] if isinstance(v, dict) else v) for k, v in config.items()
             if k.endswith("_token") and isinstance(v, (str, dict))}
  return Template(text, tuple(sorted((k, str(v)) for k, v in special.items())))


@functools.lru_cache(maxsize=8)
def _compiled(text: str):
  from jinja2 import ext, sandbox  # pylint: disable=import-outside-toplevel

  def raise_exception(message):
    raise shards.ShardError(f"the chat template refused the conversation: {message}")

  env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                              extensions=[ext.loopcontrols])
  env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False,
                                                           indent=indent)
  env.globals["raise_exception"] = raise_exception
  return env.from_string(text)


def render(messages: list, template: Template, *, add_generation_prompt: bool = False) -> str:
  """The template's text for `messages` (a list of {"role", "content"} dicts)."""
  return _compiled(template.text).render(messages=messages,
                                         add_generation_prompt=add_generation_prompt,
                                         **dict(template.variables))


def pieces(messages, template: Template, where: str = "a conversation") -> list[tuple[str, int]]:
  """The rendered conversation as consecutive (text, weight) pieces: weight 1 for each
  assistant turn (see the module docstring), 0 between them; their texts join to the whole
  rendering.

  Raises:
    ShardError: not a list of role/content messages, no assistant turn, or a template whose
      rendering of a conversation's beginning is not the beginning of its whole rendering.
  """
  if (not isinstance(messages, list) or
      not all(isinstance(m, dict) and "role" in m for m in messages)):
    raise shards.ShardError(f"{where}: `messages` is {str(messages)[:80]!r}; expected a list "
                            "of {\"role\": ..., \"content\": ...} dicts")
  turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
  if not turns:
    roles = [m["role"] for m in messages]
    raise shards.ShardError(f"{where}: a conversation without an assistant turn (roles "
                            f"{roles}): nothing to learn from; fix: drop it or add the "
                            "assistant's reply")
  full = render(messages, template)
  out, pos = [], 0
  for i in turns:
    before = render(messages[:i], template, add_generation_prompt=True)
    upto = render(messages[:i + 1], template)
    if not (upto.startswith(before) and full.startswith(upto) and len(before) >= pos):
      raise shards.ShardError(
          f"{where}: the chat template renders the conversation up to assistant turn {i} as "
          "text that is not the beginning of the whole conversation's rendering, so the "
          "assistant's tokens can't be told apart; fix: a template whose rendering only "
          "appends turns (no turn rewritten later)")
    out += [(full[pos:len(before)], 0), (full[len(before):len(upto)], 1)]
    pos = len(upto)
  out.append((full[pos:], 0))
  return [(t, w) for t, w in out if t]


def tokenize(messages, template: Template, tok, where: str = "a conversation"
             ) -> tuple[np.ndarray, np.ndarray]:
  """(ids int32 [n], weights uint8 [n]) of a conversation: each piece of `pieces` tokenized
  on its own (no special tokens added: the template writes them) and concatenated; `tok` a
  `tokenizers.Tokenizer`, or None for UTF-8 bytes."""
  parts = pieces(messages, template, where)
  if tok is None:
    encoded = shards.encode_texts([t for t, _ in parts], shards.BYTES)
  else:
    encoded = [np.asarray(e.ids, np.int32)
               for e in tok.encode_batch([t for t, _ in parts], add_special_tokens=False)]
  ids = np.concatenate(encoded).astype(np.int32)
  weights = np.concatenate([np.full(len(e), w, np.uint8) for e, (_, w) in zip(encoded, parts)])
  return ids, weights
