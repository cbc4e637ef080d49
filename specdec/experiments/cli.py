"""The ``specdec-run`` command line before Hydra starts: ``--help`` and key checks, fast.

``specdec-run --help`` (``-h``; ``experiment=<name> --help`` for that experiment's keys) lists
the config groups with their options (from ``conf/<group>/*.yaml``, each with the first line of
its comment) and the plain keys with their one-line help (the structured configs' field
metadata, :func:`specdec.experiments.config.field_help`) and defaults. It imports neither
torch, transformers nor Hydra, so it answers in a fraction of a second.

Before Hydra composes anything, every ``key=value`` override is checked against the schema of
the chosen experiment: an unknown key ends the run with one line naming the nearest valid key
(``drafterr=ngram`` -> ``did you mean 'drafter'?``), an unknown group option with the nearest
option, and the internal ``schema`` group is refused. Hydra's own flags (``-m``, ``--cfg job``,
``--hydra-help``, ...) and ``hydra.*`` overrides pass through; ``+key=value`` (adding a key on
purpose) is left to the schema check at start.
"""

from __future__ import annotations

import difflib
import shutil
import sys
import textwrap
import typing
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

from . import config as _config
from .config import CONF_DIR, GROUPS, RECIPES, SCHEMAS, field_help

__all__ = ["main", "help_text", "check_overrides", "group_options", "UsageError"]

#: Hydra flags followed by a value
_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                     "--config-dir", "-cd", "--experimental-rerun"}
_HELP = {"--help", "-h"}
#: keys of a decoding run that a recipe's help leaves out
_DECODING_KEYS = ("num_speculative_tokens", "max_new_tokens", "repeats")
WIDTH = 100


class UsageError(ValueError):
    """A command-line mistake; the message is one line and says what is accepted."""


# ------------------------------------------------------------------------------- groups


def _comment(path: Path) -> str:
    """The first comment line of a YAML file (``# @package`` lines skipped), or ''."""
    for line in path.read_text().splitlines():
        s = line.strip()
        if not s.startswith("#"):
            if s:
                break
            continue
        text = s.lstrip("#").strip()
        if text and not text.startswith("@package"):
            return text.rstrip(":")
    return ""


def group_options(group: str) -> dict[str, str]:
    """``{option: first comment line}`` of ``conf/<group>/*.yaml``, sorted by name."""
    return {p.stem: _comment(p) for p in sorted(Path(CONF_DIR, group).glob("*.yaml"))}


def _yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text()) or {}


def _group_picks(experiment: str) -> dict[str, str]:
    """The group options a run of ``experiment`` starts from: ``conf/config.yaml``'s, with the
    experiment's own ``override /<group>`` defaults."""
    picks, _ = _defaults()
    exp_file = Path(CONF_DIR, "experiment", f"{experiment}.yaml")
    if exp_file.is_file():
        for d in _yaml(exp_file).get("defaults", []):
            if isinstance(d, dict):
                (k, v), = d.items()
                g = k.replace("override", "").strip(" /")
                if g in GROUPS:
                    picks[g] = str(v)
    return picks


def _defaults() -> tuple[dict[str, str], dict]:
    """The group options ``conf/config.yaml`` picks, and its top-level values."""
    top = _yaml(Path(CONF_DIR, "config.yaml"))
    picks = {}
    for d in top.get("defaults", []):
        if isinstance(d, dict):
            (k, v), = d.items()
            if k in GROUPS:
                picks[k] = str(v)
    return picks, {k: v for k, v in top.items() if k not in ("defaults", "hydra")}


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _dataclass_defaults(cls, prefix: str = "") -> dict:
    out = {}
    for f in fields(cls):
        if f.default is not MISSING:
            out[prefix + f.name] = f.default
        elif f.default_factory is not MISSING:
            v = f.default_factory()
            if is_dataclass(v):
                out.update(_dataclass_defaults(type(v), f"{prefix}{f.name}."))
            else:
                out[prefix + f.name] = v
    return out


def _key_defaults(experiment: str) -> dict:
    """Default of each key under ``experiment``: the schema's, then ``config.yaml``'s, then the
    experiment file's (what Hydra composes, group options aside)."""
    out = _dataclass_defaults(SCHEMAS[experiment])
    _, top = _defaults()
    out.update(_flatten(top))
    exp_file = Path(CONF_DIR, "experiment", f"{experiment}.yaml")
    if exp_file.is_file():
        out.update(_flatten({k: v for k, v in _yaml(exp_file).items() if k != "defaults"}))
    return out


def _show(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    return str(getattr(v, "value", v))


def help_text(experiment: str | None = None, width: int = WIDTH) -> str:
    """The ``--help`` text: groups with options, the plain keys of ``experiment`` (default: the
    one ``conf/config.yaml`` picks) with help and default, examples."""
    experiment = experiment or _defaults()[0].get("experiment", "acceptance")
    picks = _group_picks(experiment)
    wrap = textwrap.TextWrapper(width=width, subsequent_indent=" " * 28)
    recipe = experiment in RECIPES
    lines = ["usage: specdec-run [group=option ...] [key=value ...]   (or: python -m specdec ...)", "",
             "Exact speculative decoding experiments on hybrid models. Each run writes results.jsonl,",
             "summary.md (and plots: acceptance, rollback, bench, adaptive, serve) into its folder",
             "(outputs/<experiment>/<date>_<time>/) and prints that folder.", ""]
    if recipe:
        lines += [*textwrap.wrap(f"experiment={experiment} is a training recipe: it writes models and MANIFEST.json "
                                 "into <out_dir>/zoo/ (unset: the installed package's zoo) and prints that folder.",
                                 width), ""]
    lines += ["Groups (group=option):"]
    for g in GROUPS:
        if recipe and g != "experiment":
            continue  # a recipe reads no model / drafter / rollback group
        opts = group_options(g)
        lines.append(f"  {g}=  (default: {picks.get(g, '-')})")
        for name, text in opts.items():
            lines.append(wrap.fill(f"    {name:<22}  {text}"))
    lines += ["", f"Keys of experiment={experiment} (key=value) [default]; another experiment's keys:",
              "`specdec-run experiment=<name> --help`"]
    defaults = _key_defaults(experiment)
    for key, text in field_help(SCHEMAS[experiment]).items():
        if key.split(".")[0] in ("model", "rollback") or key == "drafter.names":
            continue  # filled by the group options above
        if experiment in RECIPES and (key.split(".")[0] in ("drafter", "prompts") or key in _DECODING_KEYS):
            continue  # a recipe trains: it decodes no prompts and drafts nothing
        d = defaults.get(key)
        shown = "" if d is None and key not in defaults else f" [{_show(d)}]"
        lines.append(wrap.fill(f"  {key:<24}  {text}{shown}"))
    if not recipe:
        lines += ["", *textwrap.wrap("Keys of each target model (model.targets.N.<key>=value, N from 0; model=hf "
                                     "needs model.targets.0.name):", width)]
        for key, text in field_help(_config.TargetConfig).items():
            lines.append(wrap.fill(f"  {'model.targets.0.' + key:<24}  {text}"))
    lines += ["", "Examples:",
              "  specdec-run                                     # acceptance on the zoo: exactness, acceptance",
              "  specdec-run model=gdn-target drafter=ngram rollback=snapshot num_speculative_tokens=0",
              "  specdec-run prompts.path=my_prompts.jsonl model=gdn-target",
              "  specdec-run experiment=rollback                 # rollback strategies side by side",
              "  specdec-run experiment=bench drafter=oracle     # decode speed at a known acceptance",
              "  specdec-run -m rollback=snapshot,replay         # a sweep, one combined summary",
              "", "Hydra's flags: -m/--multirun, --cfg job (print the composed config), --hydra-help."]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ checks


def _hints(cls) -> dict:
    return typing.get_type_hints(cls, vars(_config))


def _valid(cls, parts: list[str]) -> tuple[bool, list[str]]:
    """Whether the dotted key ``parts`` exists under dataclass ``cls``; else the valid names at
    the first wrong part (for the suggestion)."""
    tp = cls
    for i, part in enumerate(parts):
        origin = typing.get_origin(tp)
        if origin is typing.Union:  # Optional[X]
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
            origin = typing.get_origin(tp)
        if is_dataclass(tp):
            hints = _hints(tp)
            if part not in hints:
                return False, list(hints)
            tp = hints[part]
        elif origin in (list, tuple) and part.isdigit():
            tp = typing.get_args(tp)[0] if typing.get_args(tp) else typing.Any
        elif tp is typing.Any or origin is dict:
            return True, []
        else:
            return False, []
    return True, []


def _all_keys(cls, prefix: str = "") -> list[str]:
    out = []
    for name, tp in _hints(cls).items():
        out.append(prefix + name)
        if is_dataclass(tp):
            out += _all_keys(tp, f"{prefix}{name}.")
    return out


def _suggest(word: str, candidates, prefix: str = "") -> str:
    near = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{prefix}{near[0]}'?)" if near else ""


def _suggest_key(key: str, candidates) -> str:
    """:func:`_suggest` for ``key`` among the keys of its own section (``experiment.x``: the other
    ``experiment.`` keys), or among all ``candidates`` for a key outside any section."""
    parent, _, name = key.rpartition(".")
    siblings = [c.rpartition(".")[2] for c in candidates if c.rpartition(".")[0] == parent] if parent else []
    # (the names alone where the section is shared)
    return _suggest(name, siblings, f"{parent}.") if siblings else _suggest(key, candidates)


def check_overrides(args: list[str]) -> None:
    """Check the ``key=value`` overrides in ``args`` before Hydra runs.

    Raises:
        UsageError: ``schema`` is set; an unknown group option; an unknown key (with the nearest
            valid key, never a ``+key`` hint).
    """
    experiments: list[str] = []
    overrides = []
    skip = False
    for a in args:
        if skip:
            skip = False
            continue
        if a in _FLAGS_WITH_VALUE:
            skip = True
            continue
        if a.startswith("-") or "=" not in a and not a.startswith("~"):
            continue
        overrides.append(a)
    for a in overrides:
        key, _, value = a.partition("=")
        key = key.lstrip("~")
        if key.split("@")[0] == "experiment":
            experiments += [v.strip() for v in value.split(",")]
    unknown = [e for e in experiments if e not in SCHEMAS]
    if unknown:
        raise UsageError(f"unknown experiment {unknown[0]!r}{_suggest(unknown[0], SCHEMAS)}; available: "
                         f"{', '.join(SCHEMAS)}")
    names = experiments or [_defaults()[0].get("experiment", "acceptance")]  # (every job of a sweep)
    schemas = [SCHEMAS[e] for e in names]
    for a in overrides:
        key, _, value = a.partition("=")
        added = key.startswith("+")
        key = key.lstrip("+~")
        root = key.split("@")[0].split(".")[0]
        if root == "schema":
            raise UsageError("'schema' is internal (the structured config of the experiment): pick the experiment "
                             f"with experiment=<name>, one of {', '.join(SCHEMAS)}")
        if root.split("/")[0] == "hydra" or added:
            continue
        if key in GROUPS and key != "experiment":
            opts = group_options(key)
            for v in value.split(","):
                v = v.strip()
                if v and v not in opts and v != "null" and "(" not in v:  # glob(...), choice(...): Hydra's
                    raise UsageError(f"{key}={v}: no such option{_suggest(v, opts)}; {key} options: "
                                     f"{', '.join(opts)}")
            continue
        if key in GROUPS:
            continue
        if key == "num_speculative_tokens" and "auto" in [v.strip() for v in value.split(",")]:
            refusing = [e for e in names if not _takes_any(SCHEMAS[e], key)]
            if refusing:
                takes = ", experiment=".join(e for e, sch in SCHEMAS.items() if _takes_any(sch, key))
                raise UsageError(f"num_speculative_tokens=auto: experiment={', experiment='.join(refusing)} takes an "
                                 f"int K; auto (K chosen per step) is taken by experiment={takes}")
        parts = key.split(".")
        if len(parts) > 2 and parts[:2] == ["model", "targets"] and parts[2].isdigit():
            _check_target_index(int(parts[2]), key, overrides, names)
        results = [_valid(s, parts) for s in schemas]
        if any(ok for ok, _ in results):
            continue
        others = [e for e, sch in SCHEMAS.items() if e not in names and key in _all_keys(sch)]  # (no wildcards)
        if others:
            raise UsageError(f"'{key}' is a key of experiment={', experiment='.join(others)}, not of "
                             f"experiment={', experiment='.join(names)}; use experiment={others[0]}")
        candidates = set(GROUPS)
        for s in schemas:
            candidates.update(_all_keys(s))
        raise UsageError(f"unknown key '{key}'{_suggest_key(key, candidates)}; `specdec-run --help` lists the keys")


def _check_target_index(index: int, key: str, overrides: list[str], experiments: list[str]) -> None:
    """Raise UsageError when ``model.targets.<index>`` is past the targets of every model config
    the run can pick (``model=`` given, else each experiment's default model)."""
    picks = [v.strip() for a in overrides if a.partition("=")[0].lstrip("+~") == "model"
             for v in a.partition("=")[2].split(",")]
    if not picks:
        picks = [_group_picks(name).get("model") for name in experiments]
    counts = {}
    for pick in picks:
        path = Path(CONF_DIR, "model", f"{pick}.yaml")
        if path.is_file():
            counts[pick] = len(_yaml(path).get("targets") or [])
    if counts and all(index >= n for n in counts.values()):
        have = "; ".join(f"model={p} has {n} (model.targets.0{'' if n == 1 else f' to {n - 1}'})"
                         for p, n in counts.items())
        raise UsageError(f"{key}: no target {index} ({have}); set keys of an existing target, or give "
                         "model.targets as a whole list")


def _takes_any(schema, name: str) -> bool:
    """Whether ``schema``'s field ``name`` is typed ``Any`` (takes a string such as ``auto``)."""
    return any(f.name == name and f.type in (typing.Any, "Any") for f in fields(schema))


# -------------------------------------------------------------------------------- main


def _experiment_arg(args: list[str]) -> str | None:
    for a in args:
        if a.startswith("experiment="):
            name = a.split("=", 1)[1]
            return name if name in SCHEMAS else None
    return None


def main(argv: list[str] | None = None) -> None:
    """Console entry point (``specdec-run``): ``--version``, ``--help`` and override checks here,
    then the Hydra app (:func:`specdec.experiments.app.run_app`). A usage error exits with status 2 and one line
    on stderr."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--version" in args:  # (specdec's, with the Hydra that runs it; Hydra's own flag names only itself)
        from importlib.metadata import PackageNotFoundError, version

        from .. import __version__
        try:
            hydra = version("hydra-core")
        except PackageNotFoundError:
            hydra = "not installed"
        print(f"specdec-run {__version__} (Hydra {hydra})")
        return
    if any(a in _HELP for a in args):
        width = min(WIDTH, shutil.get_terminal_size((WIDTH, 24)).columns)
        sys.stdout.write(help_text(_experiment_arg(args), width=max(60, width)))
        return
    try:
        check_overrides(args)
    except UsageError as err:
        print(f"specdec-run: {err}", file=sys.stderr)
        sys.exit(2)
    from .app import run_app

    run_app(args)


if __name__ == "__main__":
    main()
