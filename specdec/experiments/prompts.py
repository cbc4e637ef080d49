"""Prompts for the experiments: the shipped sets (:func:`specdec.zoo.prompts`) or a user's file.

A prompt file (``prompts.path=<file.jsonl>``) holds one JSON object per line, either

* ``{"prompt": "def fibonacci(n):"}``: text, encoded with the target's tokenizer, or
* ``{"input_ids": [1, 512, 77]}``: token ids, used as they are (a list of ints >= 0),

optionally with an ``"id"`` (default ``file-<line number>``). Blank lines are skipped;
``prompts.limit`` keeps the first prompts of the file.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["load_prompt_file", "experiment_prompts", "json_objects", "check_token_ids", "FILE_SET"]

#: the ``set`` of prompts from a user's file
FILE_SET = "file"


def json_objects(path: str | Path, option: str, example: str):
    """``(where, object)`` for each non-blank line of the JSON-lines file ``path`` given as the
    config key ``option``; ``where`` names the option, file and line for error messages.

    Raises:
        FileNotFoundError: no such file (the message shows ``example``, a valid line).
        ValueError: a file that is not UTF-8 text; a line that is not valid JSON or not a JSON object.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"{option}={path}: no such file (one JSON object per line, {example})")
    with open(p, "rb") as f:  # (bytes, decoded a line at a time: an error names its line)
        for n, raw in enumerate(f, start=1):
            where = f"{option}={path}, line {n}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{where}: not UTF-8 text ({err.reason} at byte {err.start} of the line); one JSON "
                                 f"object per line, {example}") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                what = err.msg.removesuffix(" at")  # (json's "Invalid control character at" expects a position)
                raise ValueError(f"{where}: not valid JSON ({what} at column {err.colno}); each line is one "
                                 f"object such as {example}") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{where}: expected a JSON object such as {example}, got {type(obj).__name__}")
            yield n, where, obj


def check_token_ids(ids, where: str, key: str) -> list[int]:
    """``ids`` if it is a non-empty list of ints >= 0, else ValueError naming ``where`` and ``key``."""
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                  for i in ids)):
        raise ValueError(f'{where}: "{key}" must be a non-empty list of token ids (ints >= 0)')
    return ids


def load_prompt_file(path: str | Path, limit: int | None = None) -> list[dict]:
    """The prompts of a JSON-lines file (format in the module docstring), each a dict with
    ``id``, ``set`` (``"file"``) and ``prompt`` (str) or ``input_ids`` (list of int).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not a JSON object, has neither a non-empty ``prompt`` string
            nor a non-empty ``input_ids`` list of ints >= 0 (the message names the line number),
            or a file without prompts.
    """
    out: list[dict] = []
    for n, where, obj in json_objects(path, "prompts.path", '{"prompt": "def f(x):"} or {"input_ids": [...]}'):
        rec = {"id": str(obj.get("id", f"file-{n}")), "set": FILE_SET}
        if isinstance(obj.get("prompt"), str) and obj["prompt"]:
            rec["prompt"] = obj["prompt"]
        elif "input_ids" in obj:
            rec["input_ids"] = check_token_ids(obj["input_ids"], where, "input_ids")
        else:
            raise ValueError(f'{where}: needs a non-empty "prompt" string or an "input_ids" list; keys: '
                             f"{sorted(obj)}")
        out.append(rec)
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise ValueError(f"prompts.path={path}: the file holds no prompts")
    return out


def experiment_prompts(cfg) -> list[dict]:
    """The prompts of an experiment config: ``prompts.path`` when set, else the shipped set
    ``prompts.set`` (both cut to ``prompts.limit``)."""
    limit = cfg.prompts.limit
    if cfg.prompts.get("path"):
        return load_prompt_file(str(cfg.prompts.path), limit=None if limit is None else int(limit))
    from .. import zoo

    return zoo.prompts(str(cfg.prompts.set), limit=limit)
