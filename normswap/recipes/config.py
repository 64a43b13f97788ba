"""Recipe configuration: typed dataclasses, YAML loading, ``key=value`` overrides, validation.

A recipe is a YAML file whose sections map one-to-one onto the dataclasses below. Every key has
a default, so a recipe only needs what differs (``model.source`` and ``data.path`` at least).
Overrides use dotted keys, torchtune style: ``train.lr=3e-4 data.seq_len=256 progressive.enabled=true``;
values are parsed as YAML and then coerced to the declared type of the key. Any problem (unknown
key, wrong type, bad choice, missing file) raises :class:`normswap.NormswapError` with a one-line
message that names the offending key.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from normswap.errors import NormswapError, UsageError
from normswap.options import ConvertOptions

if typing.TYPE_CHECKING:
    from normswap.recipes import tasks


@dataclass
class ModelConfig:
    """Where the teacher (original model) and the student come from."""

    source: str | None = None  # original LayerNorm model (local directory or preset): teacher and conversion source
    student: str | None = None  # a converted directory (normswap.load); None: convert `source` on the fly
    tokenizer: str | None = None  # defaults to `source`
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"
    trust_remote_code: bool = False


@dataclass
class ConvertConfig:
    """On-the-fly conversion options: :class:`normswap.ConvertOptions` fields (the same as
    ``normswap convert``) plus the number of calibration batches drawn from the recipe's data."""

    mode: Literal["auto", "exact", "all"] = "all"
    fold_gamma: bool = False
    untie: bool | None = None
    mean_carry: bool = True
    calibration_batches: int = 8
    backend: str = "auto"
    verify: bool = True

    def options(self, **overrides: Any) -> ConvertOptions:
        """The :class:`~normswap.ConvertOptions` these settings stand for (validated)."""
        fields = {k: getattr(self, k) for k in ("mode", "fold_gamma", "untie", "mean_carry", "backend", "verify")}
        return ConvertOptions(**{**fields, **overrides})


@dataclass
class TeacherConfig:
    enabled: bool = True


@dataclass
class DataConfig:
    path: str | None = None
    format: Literal["auto", "text", "jsonl", "datasets"] = "auto"
    field: str = "text"
    split: str = "train"
    seq_len: int = 128
    pack: bool = True
    eval_fraction: float = 0.05
    eval_batches: int | None = None
    max_documents: int | None = None
    batch_size: int = 8
    eval_batch_size: int = 16
    mlm_probability: float = 0.15
    neighbour_groups: int = 1
    seed: int = 0


@dataclass
class LossConfig:
    kl_weight: float = 1.0
    temperature: float = 2.0
    ce_weight: float = 0.0
    positions: Literal["all", "masked"] = "all"
    pooled_weight: float = 1.0
    hidden_weight: float = 1.0
    similarity_weight: float = 0.0
    similarity_temperature: float = 0.05
    pooling: Literal["auto", "mean", "cls"] = "auto"


@dataclass
class LoraConfig:
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] | None = None


@dataclass
class TrainConfig:
    steps: int = 1000
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    max_grad_norm: float | None = 1.0
    gradient_accumulation_steps: int = 1
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    trainable: Literal["all", "norms_and_biases", "lora"] = "all"
    dropout: float | None = 0.0
    lora: LoraConfig = field(default_factory=LoraConfig)
    seed: int = 0


@dataclass
class ProgressiveConfig:
    enabled: bool = False
    order: str | list[str] = "forward"
    group_size: int = 1
    interval: int = 100
    start_step: int = 0


@dataclass
class EvalConfig:
    every: int = 100
    before: bool = True
    keep_best: bool = True
    metric: str | None = None  # default per task: kl (LMs with a teacher), ppl (no teacher), cosine (encoder)
    patience: int | None = None  # stop after this many evaluations in a row without a better kept metric


@dataclass
class LogConfig:
    every: int = 10
    progress_bar: bool = True
    plot: bool = True


@dataclass
class CheckpointConfig:
    every: int = 500
    keep_last: int = 2
    resume: bool = False
    stop_after: int | None = None


@dataclass
class OutputConfig:
    dir: str = "runs/normswap-finetune"
    format: Literal["native", "compat"] = "native"
    overwrite: bool = False


@dataclass
class RecipeConfig:
    """A whole recipe. ``to_dict()`` is what the output manifest records."""

    task: str = "causal-lm"  # one of tasks.TASK_NAMES, checked by validate()
    model: ModelConfig = field(default_factory=ModelConfig)
    convert: ConvertConfig = field(default_factory=ConvertConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    data: DataConfig = field(default_factory=DataConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    progressive: ProgressiveConfig = field(default_factory=ProgressiveConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    output: OutputConfig = field(default_factory=OutputConfig)

    def __post_init__(self) -> None:
        # The dotted keys the user set (a recipe file of their own, a dict, overrides), as opposed to a
        # built-in recipe's or the schema's defaults; None: not known, every key counts as set. Not a
        # field, so neither to_dict() nor the recorded recipe carries it.
        self.user_set: frozenset[str] | None = None

    def is_default(self, key: str) -> bool:
        """Whether dotted ``key`` holds a default (a built-in recipe's or the schema's) rather than a
        value the user chose: a default that does not fit the model adapts to it, a chosen one is an error."""
        return self.user_set is not None and key not in self.user_set

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self, mark_required: bool = False) -> str:
        """The recipe as YAML, every key with its value. ``mark_required``: a required key that is not
        set yet (``model.source``, ``data.path``) is followed by a ``# REQUIRED`` comment saying what
        to pass, so a printed recipe reads as the template it is."""
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if not mark_required:
            return text
        missing = dict(_REQUIRED)
        if self.model.student:
            missing.pop("model.source")
        lines, section = [], ""
        for line in text.splitlines():
            if not line.startswith(" "):
                section = line.split(":", 1)[0]
            key = f"{section}.{line.strip().split(':', 1)[0]}" if line.startswith("  ") else ""
            if key in missing and line.rstrip().endswith(": null"):
                line += f"  # REQUIRED: {missing[key]}"
            lines.append(line)
        return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------- typing
_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list of {_describe(typing.get_args(tp)[0]).removeprefix('a ').removeprefix('an ')}s"
    return _TYPE_NAMES.get(tp, getattr(tp, "__name__", str(tp)))


class _Mismatch(Exception):
    pass


def _coerce(value: Any, tp: Any) -> Any:
    """``value`` as type ``tp``, accepting the obvious spellings (``"1e-4"`` for a float, ``"true"``)."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if isinstance(value, bool):  # YAML 1.1 reads no/off/yes/on as booleans
            spelled = [
                c for c in (("yes", "on", "true") if value else ("no", "off", "false")) if c in choices
            ]
            if spelled:
                return spelled[0]
            raise _Mismatch
        if value in choices:
            return value
        if str(value) in [str(c) for c in choices]:
            return next(c for c in choices if str(c) == str(value))
        raise _Mismatch
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none", "~")):
            if type(None) in args:
                return None
            raise _Mismatch
        # try the declared alternatives in order, strings last (a list stays a list)
        for arg in sorted((a for a in args if a is not type(None)), key=lambda a: a is str):
            try:
                return _coerce(value, arg)
            except _Mismatch:
                continue
        raise _Mismatch
    if origin is list:
        (item,) = typing.get_args(tp)
        if isinstance(value, str) and item is str:
            raise _Mismatch
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        return [_coerce(v, item) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "on", "1", "false", "no", "off", "0"):
            return value.lower() in ("true", "yes", "on", "1")
        raise _Mismatch
    if tp is int:
        if isinstance(value, bool):
            raise _Mismatch
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                number = float(value.replace("_", ""))
            except ValueError:
                raise _Mismatch from None
            if number.is_integer():
                return int(number)
        raise _Mismatch
    if tp is float:
        if isinstance(value, bool):
            raise _Mismatch
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise _Mismatch from None
        raise _Mismatch
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise _Mismatch
    raise _Mismatch


def _build(cls: type, data: Any, prefix: str) -> Any:
    """Instantiate dataclass ``cls`` from a mapping, checking every key and type."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise NormswapError(
            f"config key `{prefix or '<root>'}` must be a mapping of keys, got {type(data).__name__}"
        )
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if key not in names:
            raise NormswapError(f"unknown config key `{dotted}`; valid keys here: {', '.join(names)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, value, dotted)
            continue
        try:
            kwargs[key] = _coerce(value, tp)
        except _Mismatch:
            raise NormswapError(f"config key `{dotted}` must be {_describe(tp)}, got {value!r}") from None
    return cls(**kwargs)


# ---------------------------------------------------------------------------------- overrides
def parse_override(text: str) -> tuple[list[str], Any]:
    """``"train.lr=3e-4"`` -> ``(["train", "lr"], "3e-4" parsed as YAML)``."""
    if "=" not in text:
        raise NormswapError(f"override `{text}` must look like key=value (e.g. train.lr=3e-4)")
    key, raw = text.split("=", 1)
    key = key.strip().lstrip("-")
    if not key or any(not part for part in key.split(".")):
        raise NormswapError(f"override `{text}` has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def check_override(text: str) -> str:
    """Check one ``key=value`` override against the recipe schema alone (key exists, value has
    the key's type), before any recipe is read; returns the dotted key.

    The CLI uses it to answer a bad override with a command-line error (exit code 2) that names
    the override, instead of a later complaint about some other key.
    """
    parts, value = parse_override(text)
    cls: Any = RecipeConfig
    for i, part in enumerate(parts):
        dotted = ".".join(parts[: i + 1])
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            raise NormswapError(
                f"unknown config key `{dotted}` in override `{text}`; valid keys here: {', '.join(names)}"
            )
        tp = typing.get_type_hints(cls)[part]
        if dataclasses.is_dataclass(tp):
            if i == len(parts) - 1:
                if not isinstance(value, dict):
                    raise NormswapError(
                        f"config key `{dotted}` is a section; set one of its keys, e.g. {dotted}.KEY=VALUE"
                    )
                _build(tp, value, dotted)
            cls = tp
            continue
        if i != len(parts) - 1:
            raise NormswapError(
                f"config key `{dotted}` is a value, not a section; cannot set `{'.'.join(parts)}`"
            )
        try:
            _coerce(value, tp)
        except _Mismatch:
            raise NormswapError(f"config key `{dotted}` must be {_describe(tp)}, got {value!r}") from None
    return ".".join(parts)


def apply_overrides(data: dict[str, Any], overrides: list[str] | dict[str, Any] | None) -> dict[str, Any]:
    """Merge dotted ``key=value`` overrides (strings, or a ``{dotted: value}`` dict) into ``data``."""
    if not overrides:
        return data
    items = (
        [parse_override(o) for o in overrides]
        if isinstance(overrides, (list, tuple))
        else [(k.split("."), v) for k, v in overrides.items()]
    )
    for parts, value in items:
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif not isinstance(child, dict):
                raise NormswapError(
                    f"config key `{'.'.join(parts[: i + 1])}` is a value, not a section; "
                    f"cannot set `{'.'.join(parts)}`"
                )
            node = child
        node[parts[-1]] = value
    return data


# ---------------------------------------------------------------------------------- loading
def builtin_recipes_dir() -> Path:
    """Where the shipped recipes are: ``normswap/recipes/configs`` in an installed wheel (the repository's
    top-level ``recipes/``, put there at build time by ``pyproject.toml``), else ``recipes/`` of the source
    checkout this package runs from (an editable install, or the checkout on ``PYTHONPATH``)."""
    here = Path(__file__).resolve().parent
    installed = here / "configs"
    return installed if installed.is_dir() else here.parents[1] / "recipes"


def builtin_recipes() -> dict[str, Path]:
    """The shipped recipes by name (``distill-encoder`` -> its YAML path)."""
    return {p.stem: p for p in sorted(builtin_recipes_dir().glob("*.yaml"))}


def recipe_summary(path: Path) -> str:
    """The first comment line of a recipe file (what the recipe is for)."""
    for line in path.read_text().splitlines():
        text = line.lstrip("# ").strip()
        if line.startswith("#") and text:
            return text
    return ""


def find_recipe(name_or_path: str | os.PathLike) -> Path:
    """A recipe path: an existing file as given, else a built-in recipe by name (with or without .yaml).

    A name no built-in recipe has, a path (with a directory or a ``.yaml`` suffix) to no file, and a
    directory are invalid command-line arguments (:class:`UsageError`, exit 2), as a missing ``data.path`` is."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    builtin = builtin_recipes()
    stem = p.name[: -len(".yaml")] if p.name.endswith(".yaml") else p.name
    if str(name_or_path) in (stem, f"{stem}.yaml") and stem in builtin:
        return builtin[stem]
    text = str(name_or_path)
    if p.is_dir():
        raise UsageError(f"recipe {text!r} is a directory; pass a recipe YAML file or a built-in recipe name: "
                         f"{', '.join(builtin)}")
    if "/" in text or os.sep in text or p.suffix in (".yaml", ".yml"):  # a path to a file that is not there
        raise UsageError(f"recipe file {text!r} does not exist; built-in recipes: {', '.join(builtin)}")
    raise UsageError(  # a name, and no recipe has it: an invalid RECIPE argument
        f"{text!r} is not a built-in recipe nor a recipe file; built-in: {', '.join(builtin)} (list them "
        "with `normswap finetune --list`)"
    )


def _read_yaml(path: str | os.PathLike) -> dict[str, Any]:
    p = find_recipe(path)
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        line = getattr(getattr(exc, "problem_mark", None), "line", None)
        where = f" (line {line + 1})" if line is not None else ""
        raise NormswapError(
            f"recipe file {str(p)!r} is not valid YAML{where}: {getattr(exc, 'problem', exc)}"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise NormswapError(
            f"recipe file {str(p)!r} must be a mapping of sections (task:, model:, data: ...)"
        )
    return data


def load_config(
    config: str | os.PathLike | dict[str, Any] | RecipeConfig,
    overrides: list[str] | dict[str, Any] | None = None,
    *,
    check_paths: bool = True,
) -> RecipeConfig:
    """Build a validated :class:`RecipeConfig` from a YAML path, a dict, or a config, plus overrides.

    The config records which keys the user set (:meth:`RecipeConfig.is_default`): those of a dict, of
    a recipe file of their own and of the overrides; a built-in recipe's keys are defaults."""
    user_set: frozenset[str] | None
    if isinstance(config, RecipeConfig):
        data, user_set = config.to_dict(), config.user_set
    elif isinstance(config, dict):
        data, user_set = _deep_copy(config), _dotted_keys(config)
    else:
        data = _read_yaml(config)
        user_set = frozenset() if is_builtin(find_recipe(config)) else _dotted_keys(data)
    data = apply_overrides(data, overrides)
    cfg = _build(RecipeConfig, data, "")
    validate(cfg, check_paths=check_paths)
    if user_set is not None:
        cfg.user_set = user_set | _dotted_keys(apply_overrides({}, overrides))
    return cfg


def is_builtin(path: Path) -> bool:
    """Whether ``path`` is one of the recipes shipped in the wheel (its keys are defaults, not choices)."""
    return path.resolve().parent == builtin_recipes_dir()


def _dotted_keys(data: Any, prefix: str = "") -> frozenset[str]:
    """Every key of a nested mapping, dotted (``{"data": {"seq_len": 8}}`` -> data, data.seq_len)."""
    if not isinstance(data, dict):
        return frozenset()
    keys: set[str] = set()
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        keys |= {dotted, *_dotted_keys(value, dotted + ".")}
    return frozenset(keys)


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


def _positive(value: float | int | None, key: str, *, zero_ok: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not zero_ok):
        raise NormswapError(f"config key `{key}` must be {'>= 0' if zero_ok else '> 0'}, got {value!r}")


# numeric keys that must be > 0 (False) or may be 0 (True); None means "not set" (left to the default)
_POSITIVE_KEYS = (
    ("data.seq_len", False), ("data.batch_size", False), ("data.eval_batch_size", False),
    ("data.eval_batches", False), ("data.max_documents", False), ("data.neighbour_groups", False),
    ("train.steps", False), ("train.lr", False), ("train.weight_decay", True), ("train.warmup_steps", True),
    ("train.max_grad_norm", False), ("train.gradient_accumulation_steps", False), ("train.lora.r", False),
    ("train.dropout", True), ("train.lora.dropout", True),
    ("loss.temperature", False), ("loss.kl_weight", True), ("loss.ce_weight", True), ("loss.pooled_weight", True),
    ("loss.hidden_weight", True), ("loss.similarity_weight", True),
    ("convert.calibration_batches", True),
    ("progressive.group_size", False), ("progressive.interval", False), ("progressive.start_step", True),
    ("eval.every", False), ("eval.patience", False), ("log.every", False),
    ("checkpoint.every", False), ("checkpoint.keep_last", False), ("checkpoint.stop_after", False),
)


def validate(cfg: RecipeConfig, *, check_paths: bool = True) -> None:
    """Cross-key checks. Each failure names the key to fix.

    The checks run in a fixed order (the first failure is the one reported): the task and the
    conversion options, the required keys, the paths (``check_paths``: off where a config is only
    described, not run), numeric ranges, then the keys that constrain each other.
    """
    from normswap.recipes import tasks  # torch: here, so that --list and the override checks stay light

    task = tasks.get(cfg.task)  # an unknown task name fails here, with the valid ones listed
    _check_convert_options(cfg)
    if check_paths:  # a recipe only described (--print-config) may still lack its model and data
        _check_required_keys(cfg)
        _check_paths(cfg)
    _check_ranges(cfg)
    _check_neighbour_groups(cfg, task)
    if cfg.data.seq_len < 4:
        raise NormswapError(f"config key `data.seq_len` must be at least 4, got {cfg.data.seq_len}")
    task.check_losses(cfg)  # something must be trained, and teacher terms need a teacher
    _check_progressive(cfg)
    task.check_metric(cfg)
    _check_training(cfg)


def _check_convert_options(cfg: RecipeConfig) -> None:
    """The ``convert`` section must make valid :class:`~normswap.ConvertOptions` (its own one-line errors)."""
    try:
        cfg.convert.options()
    except NormswapError as exc:
        raise NormswapError(f"config section `convert`: {exc}") from exc


# the keys a run cannot do without, and what to pass for each (to_yaml marks them; the checks below)
_REQUIRED = (
    ("model.source", "pass model.source=DIR (the original model directory or a preset)"),
    ("data.path", "pass data.path=FILE (a text file, a JSONL file or a datasets directory)"),
)


def _check_required_keys(cfg: RecipeConfig) -> None:
    """A model to start from and data to train on: usage errors (exit 2), there is no default for them."""
    if not cfg.model.source and not cfg.model.student:
        raise UsageError(f"config key `model.source` is required: {dict(_REQUIRED)['model.source']}")
    if not cfg.data.path:
        raise UsageError(f"config key `data.path` is required: {dict(_REQUIRED)['data.path']}")


def _check_paths(cfg: RecipeConfig) -> None:
    """Every path the run reads exists (a preset name stands for a model or tokenizer): normswap never
    downloads, so a missing directory fails here rather than hours into a run."""
    from normswap import presets  # torch: here, so that --list and the override checks stay light

    for key, value in (
        ("model.source", cfg.model.source),
        ("model.student", cfg.model.student),
        ("model.tokenizer", cfg.model.tokenizer),
    ):
        if value and not Path(value).exists() and not (key != "model.student" and presets.is_preset(value)):
            raise NormswapError(
                f"config key `{key}`: {value!r} does not exist (normswap never downloads; "
                f"give a local directory or a preset: {', '.join(presets.names())})"
            )
    if not Path(cfg.data.path).exists():
        raise NormswapError(f"config key `data.path`: {cfg.data.path!r} does not exist")


def _check_ranges(cfg: RecipeConfig) -> None:
    """Each numeric key on its own: counts and rates positive, fractions and probabilities inside (0, 1)."""
    for key, zero_ok in _POSITIVE_KEYS:
        _positive(operator.attrgetter(key)(cfg), key, zero_ok=zero_ok)
    if not 0.0 < cfg.data.eval_fraction < 1.0:
        raise NormswapError(
            f"config key `data.eval_fraction` must be between 0 and 1, got {cfg.data.eval_fraction}"
        )
    if not 0.0 < cfg.data.mlm_probability < 1.0:
        raise NormswapError(
            f"config key `data.mlm_probability` must be between 0 and 1, got {cfg.data.mlm_probability}"
        )
    if cfg.train.dropout is not None and cfg.train.dropout >= 1.0:
        raise NormswapError(f"config key `train.dropout` must be below 1, got {cfg.train.dropout}")
    if len(cfg.train.betas) != 2 or not all(0.0 <= b < 1.0 for b in cfg.train.betas):
        raise NormswapError(f"config key `train.betas` must be two numbers in [0, 1), got {cfg.train.betas}")


def _check_neighbour_groups(cfg: RecipeConfig, task: tasks.Task) -> None:
    """Neighbour groups sort documents by the teacher's sentence embeddings, so they need an embedding
    task with a teacher, and each batch must split into whole groups."""
    if cfg.data.neighbour_groups <= 1:
        return
    if not task.embeds or not cfg.teacher.enabled:
        raise NormswapError(
            "config key `data.neighbour_groups` groups documents by the teacher's sentence embeddings: "
            "it needs task: encoder with a teacher (set it to 1)"
        )
    if cfg.data.batch_size % cfg.data.neighbour_groups:
        raise NormswapError(
            f"config key `data.neighbour_groups` ({cfg.data.neighbour_groups}) must divide "
            f"`data.batch_size` ({cfg.data.batch_size})"
        )


def _check_progressive(cfg: RecipeConfig) -> None:
    """Progressive swapping starts the approximate norms as LayerNorm, so the conversion must leave them
    (``mode: exact``), and its order is a direction or a list of module-name patterns."""
    if not cfg.progressive.enabled:
        return
    if not cfg.model.student and cfg.convert.mode != "exact":
        # a given student converted with mode="exact" still has LayerNorms to swap: checked at run time
        raise NormswapError(
            "config key `convert.mode` must be 'exact' when `progressive.enabled` is true "
            "(the approximate norms start as LayerNorm and are swapped during training)"
        )
    order = cfg.progressive.order
    if isinstance(order, str) and order not in ("forward", "reverse"):
        raise NormswapError(
            f"config key `progressive.order` must be 'forward', 'reverse' or a list of "
            f"module-name patterns, got {order!r}"
        )


def _check_training(cfg: RecipeConfig) -> None:
    """The training keys that depend on each other or on the machine: LoRA targets, fp16 (GPU only),
    early stopping (needs the best checkpoint kept) and a stop point within the run."""
    if cfg.train.trainable == "lora" and cfg.train.lora.target_modules == []:
        raise NormswapError(
            "config key `train.lora.target_modules` must name at least one module (or be null)"
        )
    if cfg.train.mixed_precision == "fp16" and not _cuda_available():
        raise NormswapError("config key `train.mixed_precision`: fp16 needs a GPU; use bf16 or 'no' on CPU")
    if cfg.eval.patience is not None and not cfg.eval.keep_best:
        raise NormswapError(
            "config key `eval.patience` needs `eval.keep_best: true` (it stops when the kept metric stops improving)"
        )
    if cfg.checkpoint.stop_after is not None and cfg.checkpoint.stop_after > cfg.train.steps:
        raise NormswapError(
            f"config key `checkpoint.stop_after` ({cfg.checkpoint.stop_after}) is past "
            f"`train.steps` ({cfg.train.steps})"
        )


def selection_metric(cfg: RecipeConfig) -> tuple[str, bool]:
    """The held-out metric ``eval.keep_best`` ranks by, and whether higher is better."""
    from normswap.recipes import tasks

    name = cfg.eval.metric or tasks.get(cfg.task).default_metric(cfg.teacher.enabled)
    return name, name in tasks.HIGHER_IS_BETTER


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001
        return False
