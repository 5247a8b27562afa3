"""A tokenized cache: text, JSONL or Parquet sources tokenized once into ArrayRecord shards
plus a manifest (`build`), and opened for training (`open_cache`).

Layout of a cache directory:
  plan.json      the sources, tokenizer and shard tasks, written first (a rerun checks it)
  shards/shard-00003-of-00012.array_record (+ .json: its counts, the mark that it is done)
  tokenizer.json (and tokenizer_config.json) copied from the tokenizer used
  manifest.json  written last: format, kind ("text" or "chat"), tokenizer {name, sha256,
                 vocab}, sources [{path, bytes}], shards [{file, docs, tokens, loss_tokens,
                 max_doc_tokens}], totals
A killed `build` rerun with the same inputs tokenizes only the shards without a .json.
Shards are tokenized in parallel processes (`concurrent.futures`; forked on Linux, so they
start without importing anything again: the command never starts jax's backend; each loads
the tokenizer itself and uses one core).
"""
from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import json
import multiprocessing
import os
import shutil
import sys
import time
from typing import NamedTuple

import fnscale as fs
from recipes.lm import chat, shards

FORMAT = "fnscale-token-cache"
VERSION = 1
TARGET_SHARD_BYTES = 64 << 20  # source bytes per shard


@dataclasses.dataclass(frozen=True)
class BuildSpec:
  """What `build` makes: `sources` (files, directories or globs, local or gs://) tokenized
  with `tokenizer` into `out`; `field` of JSONL/Parquet records ("text", or "messages"
  with `chat`); `workers` processes; `shard_bytes` source bytes per shard."""
  sources: tuple[str, ...]
  out: str
  tokenizer: str = shards.BYTES
  chat: bool = False
  chat_template: str = ""
  field: str = ""
  workers: int = 1
  shard_bytes: int = TARGET_SHARD_BYTES


class Cache(NamedTuple):
  """An opened cache: its directory, manifest and shard paths (checked readable)."""
  path: str
  manifest: dict
  shard_paths: tuple[str, ...]

  @property
  def weighted(self) -> bool:
    return self.manifest["kind"] == "chat"


def _error(e: Exception) -> fs.InputError:
  return fs.InputError(str(e))


def list_files(source: str) -> list[tuple[str, int]]:
  """(path, bytes) of the files of a source: a file, a directory (recursively) or a glob;
  local or gs://, sorted.

  Raises:
    InputError: nothing there.
  """
  from etils import epath  # pylint: disable=import-outside-toplevel
  p = epath.Path(source)
  if any(c in source for c in "*?["):
    base, pattern = _glob_split(source)
    found = list(epath.Path(base).glob(pattern))
  elif p.is_dir():
    found = _walk(p)
  else:
    found = [p] if p.exists() else []
  files = sorted((os.fspath(f), f.stat().length) for f in found if f.is_file())
  if not files:
    raise fs.InputError(f"source {source!r}: no such file, or no files in that directory or "
                        "glob; pass text, .jsonl or .parquet files, directories or globs")
  return files


def _walk(d) -> list:
  """Every path under directory `d` (epath's rglob refuses `**` on object stores)."""
  out = []
  for child in d.iterdir():
    out += _walk(child) if child.is_dir() else [child]
  return out


def _glob_split(source: str) -> tuple[str, str]:
  parts = source.split("/")
  i = next(i for i, part in enumerate(parts) if any(c in part for c in "*?["))
  return "/".join(parts[:i]) or ".", "/".join(parts[i:])


def plan(files: list[tuple[str, int]], shard_bytes: int) -> list[shards.Task]:
  """Shard tasks of `files`: consecutive text files grouped up to `shard_bytes`, JSONL files
  cut into byte ranges of `shard_bytes`, Parquet files into runs of row groups."""
  tasks, group, size = [], [], 0
  for path, n in files:
    kind = shards.kind_of(path)
    if kind == "text":
      group.append(path)
      size += n
      if size >= shard_bytes:
        tasks.append(shards.Task(tuple(group), "text"))
        group, size = [], 0
      continue
    if group:  # shards keep the order of the files
      tasks.append(shards.Task(tuple(group), "text"))
      group, size = [], 0
    if kind == "jsonl":
      tasks += [shards.Task((path,), "jsonl", a, min(n, a + shard_bytes))
                for a in range(0, max(n, 1), shard_bytes)]
    else:
      tasks += _parquet_tasks(path, n, shard_bytes)
  if group:
    tasks.append(shards.Task(tuple(group), "text"))
  return tasks


def _parquet_tasks(path: str, n: int, shard_bytes: int) -> list[shards.Task]:
  import pyarrow.parquet as pq  # pylint: disable=import-outside-toplevel
  from etils import epath  # pylint: disable=import-outside-toplevel
  try:
    with epath.Path(path).open("rb") as f:
      groups = pq.ParquetFile(f).metadata.num_row_groups
  except Exception as e:  # pylint: disable=broad-except  (pyarrow's own error types)
    raise fs.InputError(f"{path}: not a readable Parquet file ({e}); fix or remove it") from None
  per = max(1, int(groups * shard_bytes // max(n, 1)))
  return [shards.Task((path,), "parquet", a, min(groups, a + per)) for a in range(0, groups, per)]


def _shard_name(k: int, n: int) -> str:
  return f"shard-{k:05d}-of-{n:05d}.array_record"


def _plan_json(spec: BuildSpec, files, tasks, identity) -> dict:
  return {"format": FORMAT, "version": VERSION, "kind": "chat" if spec.chat else "text",
          "field": spec.field or (shards.CHAT_KEY if spec.chat else shards.TEXT_KEY),
          "tokenizer": identity, "sources": [{"path": p, "bytes": n} for p, n in files],
          "tasks": [t._asdict() for t in tasks]}


def _check_same(out: str, new: dict) -> None:
  """A rerun into `out` must have the inputs of the build that began there."""
  old_path = os.path.join(out, "plan.json")
  if not os.path.exists(old_path):
    return
  with open(old_path) as f:
    old = json.load(f)
  old["tasks"] = [dict(t, paths=tuple(t["paths"])) for t in old["tasks"]]
  new = json.loads(json.dumps(new))
  new["tasks"] = [dict(t, paths=tuple(t["paths"])) for t in new["tasks"]]
  diff = [k for k in new if old.get(k) != new[k]]
  if diff:
    raise fs.InputError(
        f"{out} holds a cache begun with other inputs (differing: {', '.join(diff)}); fix: "
        "rerun with the same sources, tokenizer and options to finish it, or write to another "
        "--out (or delete that directory)")


def _tokenizer(spec: BuildSpec) -> shards.Tokenizer:
  if not spec.chat:
    return shards.Tokenizer(spec.tokenizer)
  template = chat.load_template(shards.tokenizer_file(spec.tokenizer)
                                if spec.tokenizer != shards.BYTES else shards.BYTES,
                                spec.chat_template)
  return shards.Tokenizer(spec.tokenizer, functools.partial(chat.tokenize, template=template))


def _copy_tokenizer(spec: BuildSpec) -> None:
  if spec.tokenizer == shards.BYTES:
    return
  src = shards.tokenizer_file(spec.tokenizer)
  shutil.copyfile(src, os.path.join(spec.out, "tokenizer.json"))
  cfg = os.path.join(os.path.dirname(src), "tokenizer_config.json")
  if os.path.isfile(cfg):
    shutil.copyfile(cfg, os.path.join(spec.out, "tokenizer_config.json"))


def build(spec: BuildSpec, say=print) -> dict:
  """Tokenizes `spec.sources` into a cache at `spec.out` (see the module docstring);
  returns the manifest plus "run": this run's shards, tokens, seconds and processes. Shards
  already done (a rerun) are kept.

  Raises:
    InputError: missing sources or tokenizer, bad records (naming the file and byte), a
      conversation without an assistant turn, an `out` begun with other inputs.
  """
  if spec.workers < 1 or spec.shard_bytes < 1:
    raise fs.InputError(f"workers={spec.workers}, shard_bytes={spec.shard_bytes}: expected "
                        ">= 1")
  if spec.out.startswith("gs://"):
    raise fs.InputError(f"out={spec.out!r}: write the cache to a local directory (or a "
                        "bucket mounted with gcsfuse): ArrayRecord files are read by path")
  try:
    identity = shards.tokenizer_identity(spec.tokenizer)
    tokenizer = _tokenizer(spec)
  except shards.ShardError as e:
    raise _error(e) from None
  files = [f for s in spec.sources for f in list_files(s)]
  tasks = plan(files, spec.shard_bytes)
  pj = _plan_json(spec, files, tasks, identity)
  os.makedirs(os.path.join(spec.out, "shards"), exist_ok=True)
  _check_same(spec.out, pj)
  with open(os.path.join(spec.out, "plan.json"), "w") as f:
    json.dump(pj, f, indent=1)
  _copy_tokenizer(spec)
  names = [_shard_name(k, len(tasks)) for k in range(len(tasks))]
  paths = [os.path.join(spec.out, "shards", n) for n in names]
  todo = [k for k, p in enumerate(paths) if not os.path.exists(p + ".json")]
  used = min(spec.workers, len(todo))  # no more processes than shards to write
  say(f"tokenizing {len(files)} files into {len(tasks)} shards with {identity['name']} "
      f"({len(tasks) - len(todo)} already done), {processes(used)}")
  t0 = time.perf_counter()
  _run(todo, tasks, paths, tokenizer, pj["field"], used)
  seconds = time.perf_counter() - t0
  manifest = _manifest(pj, names, paths)
  with open(os.path.join(spec.out, "manifest.json.tmp"), "w") as f:
    json.dump(manifest, f, indent=1)
  os.replace(os.path.join(spec.out, "manifest.json.tmp"), os.path.join(spec.out, "manifest.json"))
  done = sum(manifest["shards"][k]["tokens"] for k in todo)
  return dict(manifest, run={"shards": len(todo), "tokens": done, "seconds": seconds,
                             "workers": used})


def processes(n: int) -> str:
  """"1 process", "4 processes"."""
  return f"{n} process" + ("es" if n != 1 else "")


def _run(todo, tasks, paths, tokenizer, field: str, workers: int) -> None:
  """Runs the shards `todo`: in this process for one worker, else in worker processes."""
  try:
    if workers <= 1 or len(todo) <= 1:
      for k in todo:
        shards.write_shard(tasks[k], paths[k], tokenizer, field)
      return
    ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with cf.ProcessPoolExecutor(workers, mp_context=ctx) as pool:
      jobs = [pool.submit(shards.write_shard, tasks[k], paths[k], tokenizer, field)
              for k in todo]
      for j in cf.as_completed(jobs):
        j.result()
  except shards.ShardError as e:
    raise _error(e) from None


def _manifest(pj: dict, names, paths) -> dict:
  entries = []
  for name, path in zip(names, paths):
    with open(path + ".json") as f:
      entries.append({"file": name, **json.load(f)})
  return {k: v for k, v in pj.items() if k != "tasks"} | {
      "shards": entries, "docs": sum(e["docs"] for e in entries),
      "tokens": sum(e["tokens"] for e in entries),
      "loss_tokens": sum(e["loss_tokens"] for e in entries),
      "max_doc_tokens": max((e["max_doc_tokens"] for e in entries), default=0)}


def is_cache(path: str) -> bool:
  return os.path.isfile(os.path.join(path, "manifest.json"))


def open_cache(path: str) -> Cache:
  """Opens a cache directory: its manifest, and every shard checked readable with the
  record count the manifest says.

  Raises:
    InputError: no manifest (an unfinished build: rerun it), another format, or an
      unreadable or short shard (named).
  """
  mpath = os.path.join(path, "manifest.json")
  if "://" not in path and not os.path.isdir(path):
    raise fs.InputError(f"dataset {path!r}: no such directory (a token cache is a directory "
                        "recipes/pretokenize.py --out=DIR made)")
  if not os.path.isfile(mpath):
    what = ("an unfinished build (plan.json but no manifest.json): rerun the same pretokenize "
            "command to finish it" if os.path.isfile(os.path.join(path, "plan.json")) else
            "no manifest.json: make it with recipes/pretokenize.py")
    raise fs.InputError(f"dataset {path!r} is not a token cache: {what}")
  with open(mpath) as f:
    manifest = json.load(f)
  if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
    raise fs.InputError(f"{mpath}: format {manifest.get('format')!r} version "
                        f"{manifest.get('version')!r}, expected {FORMAT!r} {VERSION}; remake "
                        "the cache with this checkout's recipes/pretokenize.py")
  paths = tuple(os.path.join(path, "shards", s["file"]) for s in manifest["shards"])
  for p, s in zip(paths, manifest["shards"]):
    _check_shard(p, s["docs"])
  return Cache(path, manifest, paths)


def _check_shard(path: str, docs: int) -> None:
  from array_record.python import array_record_module as ar  # pylint: disable=import-outside-toplevel
  try:
    reader = ar.ArrayRecordReader(path)
    n = reader.num_records()
    if n:
      reader.read([0, n - 1])  # the first and last records decode
    reader.close()
  except Exception as e:  # pylint: disable=broad-except  (array_record raises plain errors)
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
    raise fs.InputError(f"shard {path} is unreadable ({first}); fix: delete it and its .json "
                        "and rerun the pretokenize command (it remakes only missing shards)"
                        ) from None
  if n != docs:
    raise fs.InputError(f"shard {path} holds {n} documents, the manifest says {docs}; fix: "
                        "delete it and its .json and rerun the pretokenize command")


def check_tokenizer(c: Cache, tokenizer: str) -> str:
  """The tokenizer a run on cache `c` uses: `tokenizer` ("" = the cache's own copy, or
  bytes), which must be the one the cache was made with.

  Raises:
    InputError: another tokenizer (by the hash of its serialisation), naming both.
  """
  made = c.manifest["tokenizer"]
  if not tokenizer:
    return shards.BYTES if made["name"] == shards.BYTES else os.path.join(c.path, "tokenizer.json")
  try:
    mine = shards.tokenizer_identity(tokenizer)
  except shards.ShardError as e:
    raise _error(e) from None
  if mine["sha256"] != made["sha256"]:
    raise fs.InputError(
        f"dataset {c.path!r} was tokenized with {made['name']} (sha256 {made['sha256']}, vocab "
        f"{made['vocab']}), not this run's tokenizer {tokenizer!r} (sha256 {mine['sha256']}, "
        f"vocab {mine['vocab']}); fix: pass the cache's tokenizer (or none: it has a copy), or "
        "make a cache with this tokenizer (recipes/pretokenize.py --tokenizer=...)")
  return tokenizer
