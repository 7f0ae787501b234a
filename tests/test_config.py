"""TOML -> JobConfig: valid jobs load and resolve; every invalid one fails with one line naming key and fix."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from pp_tp.cli.job import check_job
from pp_tp.config import (
    JobConfig,
    ParallelConfig,
    config_from_dict,
    config_to_dict,
    format_config,
    load_config,
    resolve_parallel,
    validate,
)
from pp_tp.config.fields import toml_key
from pp_tp.config.kinds import MODEL_KINDS
from pp_tp.errors import ConfigError
from pp_tp.layout import ModelDims
from pp_tp.preflight import check_model_shape

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

# A valid job at world size 8: pp2 x tp2 x dp_shard(-1 -> 2), batch 8 = dp 2 * microbatches 4.
BASE_TOML = """
[model]
vocab_size = 256
dim = 64
n_layers = 4
n_heads = 4
ffn_dim = 176
max_seq_len = 256

[parallel]
pp = 2
tp = 2
dp_shard = -1
schedule = "1F1B"
microbatches = 4

[training]
steps = 3
batch_size = 8
seq_len = 64
"""
WORLD = 8


@pytest.fixture
def base(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(BASE_TOML)
    return str(path)


@pytest.fixture(autouse=True)
def _no_env_world_size(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def config_error(fn, *args, **kwargs) -> str:
    """The ConfigError message of fn(...), asserted to be a single line."""
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- valid jobs --------------------------------------------------------------------------------


def test_base_loads_and_resolves_dp_shard(base):
    cfg = load_config(base, world_size=WORLD)
    assert cfg.parallel.dp_shard == 2
    assert cfg.parallel.dp == 2 and cfg.parallel.num_stages == 2
    assert cfg.model.n_layers == 4 and cfg.training.steps == 3


@pytest.mark.parametrize(
    "overrides, field, expected",
    [
        (["parallel.tp=1", "training.batch_size=16"], "tp", 1),
        (["parallel.schedule=GPipe"], "schedule", "GPipe"),
        (['parallel.schedule="GPipe"'], "schedule", "GPipe"),
        (["parallel.split=layers_per_stage", "parallel.layers_per_stage=[1,3]"], "layers_per_stage", [1, 3]),
        (["parallel.fsdp_reshard_after_forward=never"], "fsdp_reshard_after_forward", "never"),
        (["parallel.fsdp_reshard_after_forward=2"], "fsdp_reshard_after_forward", 2),
        (["parallel.compile=true"], "compile", True),
    ],
)
def test_overrides(base, overrides, field, expected):
    assert getattr(load_config(base, overrides, world_size=WORLD).parallel, field) == expected


def test_override_changes_the_resolved_dp_shard(base):
    assert load_config(base, ["parallel.tp=1", "training.batch_size=16"], world_size=WORLD).parallel.dp_shard == 4


def test_int_is_accepted_for_a_float_field(base):
    lr = load_config(base, ["training.lr=1"], world_size=WORLD).training.lr
    assert lr == 1.0 and isinstance(lr, float)


def test_world_size_from_env(base, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert load_config(base).parallel.dp_shard == 2


def test_world_size_defaults_to_the_product_of_degrees(base):
    assert load_config(base).parallel.dp_shard == 1


def test_layers_per_stage_may_leave_a_stage_without_layers(base):
    cfg = load_config(
        base,
        ["model.n_layers=1", "parallel.split=layers_per_stage", "parallel.layers_per_stage=[0,1]"],
        world_size=WORLD,
    )
    assert cfg.parallel.layers_per_stage == [0, 1]


def test_explicit_split_is_not_bound_by_layer_count(base):
    fqns = '[["tok_embeddings", "layers.0"], ["norm", "output"]]'
    cfg = load_config(
        base, ["model.n_layers=1", "parallel.split=explicit", f"parallel.stage_fqns={fqns}"], world_size=WORLD
    )
    assert cfg.parallel.stage_fqns[1] == ["norm", "output"]


def test_text_data_with_an_existing_file(base, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello")
    cfg = load_config(base, ["data.source=text", f'data.path="{corpus}"'], world_size=WORLD)
    assert cfg.data.path == str(corpus)


def test_format_config_loads_back_to_the_same_config(base):
    cfg = load_config(base, ["parallel.split=layers_per_stage", "parallel.layers_per_stage=[1,3]"], world_size=WORLD)
    text = format_config(cfg)
    assert "[parallel]" in text and "dp_shard = 2" in text and "layers_per_stage = [1, 3]" in text
    assert config_from_dict(tomllib.loads(text), world_size=WORLD) == cfg
    assert config_to_dict(cfg)["parallel"]["dp_shard"] == 2


def test_validate_on_dataclasses_built_in_python():
    cfg = validate(JobConfig(), world_size=1)
    assert cfg.parallel.dp_shard == 1


@pytest.mark.parametrize(
    "schedule, expected",
    [
        ("GPipe", 1),
        ("1F1B", 1),
        ("Interleaved1F1B", 2),
        ("LoopedBFS", 2),
        ("InterleavedZeroBubble", 2),
        ("ZBVZeroBubble", 2),
        ("DualPipeV", 2),
    ],
)
def test_stages_per_rank_defaults_from_the_schedule(schedule, expected):
    pcfg = resolve_parallel(ParallelConfig(pp=2, schedule=schedule, microbatches=4), world_size=2)
    assert pcfg.stages_per_rank == expected and pcfg.num_stages == 2 * expected


def test_stages_per_rank_defaults_from_a_csv_schedule(tmp_path):
    csv = tmp_path / "v.csv"
    csv.write_text("0F0,1F0,1B0,0B0\n")  # one rank, two stages
    assert resolve_parallel(ParallelConfig(pp=1, schedule=str(csv)), world_size=1).stages_per_rank == 2


def test_resolve_parallel_returns_a_resolved_copy():
    pcfg = ParallelConfig(pp=2, tp=2, dp_shard=-1, microbatches=4)
    resolved = resolve_parallel(pcfg, world_size=8)
    assert resolved.dp_shard == 2 and pcfg.dp_shard == -1


def test_check_model_shape_on_plain_values():
    pcfg = ParallelConfig(pp=2, tp=4)
    dims = ModelDims(
        n_layers=2, dim=128, n_heads=8, n_kv_heads=8, ffn_dim=64, vocab_size=128, max_seq_len=64, tied=False
    )
    check_model_shape(pcfg, dims)
    assert "model.n_kv_heads = 2" in config_error(check_model_shape, pcfg, dataclasses.replace(dims, n_kv_heads=2))


# --- invalid jobs: (overrides, world size, fragments the message must contain) -----------------

ERROR_CASES = [
    # unknown names, with did-you-mean
    (["paralel.tp=2"], WORLD, ["unknown section [paralel]", "did you mean [parallel]"]),
    (["parallel.tpp=2"], WORLD, ["unknown key parallel.tpp", "did you mean parallel.tp"]),
    # types
    (['parallel.tp="2"'], WORLD, ['parallel.tp = "2" has type string', "integer"]),
    (["parallel.pp=true"], WORLD, ["parallel.pp = true has type boolean", "integer"]),
    (["training.steps=1.5"], WORLD, ["training.steps = 1.5 has type float"]),
    (["training.lr=true"], WORLD, ["training.lr = true has type boolean", "float"]),
    (["parallel.compile=1"], WORLD, ["parallel.compile = 1 has type integer", "boolean"]),
    (["parallel.schedule=3"], WORLD, ["parallel.schedule = 3 has type integer", "string"]),
    (['parallel.layers_per_stage=["a"]'], WORLD, ["parallel.layers_per_stage", "array of integer"]),
    (["parallel.stage_fqns=[1]"], WORLD, ["parallel.stage_fqns", "array of array of string"]),
    (["parallel.fsdp_reshard_after_forward=1.5"], WORLD, ["parallel.fsdp_reshard_after_forward", "string or integer"]),
    # degrees
    (["parallel.pp=0"], WORLD, ["parallel.pp = 0 must be >= 1"]),
    (["parallel.tp=-1"], WORLD, ["parallel.tp = -1 must be >= 1"]),
    (["parallel.dp_replicate=0"], WORLD, ["parallel.dp_replicate = 0 must be >= 1"]),
    (["parallel.dp_shard=0"], WORLD, ["parallel.dp_shard = 0", "-1"]),
    (["parallel.dp_shard=-2"], WORLD, ["parallel.dp_shard = -2", "-1"]),
    (["parallel.microbatches=0"], WORLD, ["parallel.microbatches = 0 must be >= 1"]),
    (["parallel.stages_per_rank=0"], WORLD, ["parallel.stages_per_rank = 0 must be >= 1"]),
    # degree product vs world size
    (["parallel.dp_shard=1"], WORLD, ["world size is 8", "set parallel.dp_shard = 2"]),
    (["parallel.dp_shard=1"], 6, ["world size is 6", "parallel.dp_replicate"]),
    ([], 6, ["parallel.dp_shard = -1 cannot fill world size 6", "parallel.tp"]),
    ([], 0, ["world size 0 must be >= 1"]),
    # tp divisibility
    (["parallel.pp=1", "parallel.tp=8"], WORLD, ["model.n_heads = 4 is not divisible by parallel.tp = 8"]),
    (
        ["model.n_heads=8", "model.n_kv_heads=2", "model.dim=128", "parallel.tp=4"],
        WORLD,
        ["model.n_kv_heads = 2 is not divisible by parallel.tp = 4"],
    ),
    (["model.ffn_dim=175"], WORLD, ["model.ffn_dim = 175 is not divisible by parallel.tp = 2"]),
    (["model.vocab_size=255"], WORLD, ["model.vocab_size = 255 is not divisible by parallel.tp = 2"]),
    # model shape
    (["model.dim=66"], WORLD, ["model.dim = 66 is not divisible by model.n_heads = 4"]),
    (["model.n_kv_heads=3"], WORLD, ["model.n_heads = 4 is not divisible by model.n_kv_heads = 3"]),
    (["model.dim=12"], WORLD, ["odd head_dim", "RoPE"]),
    (["model.n_heads=0"], WORLD, ["model.n_heads = 0 must be >= 1"]),
    (["model.n_layers=1"], WORLD, ["model.n_layers = 1 is fewer than the 2 pipeline stages"]),
    (
        ["model.n_layers=3", "parallel.schedule=Interleaved1F1B", "parallel.stages_per_rank=2"],
        WORLD,
        ["model.n_layers = 3 is fewer than the 4 pipeline stages"],
    ),
    (
        ["model.tie_embeddings=true", "parallel.embedding=replicate"],
        WORLD,
        ["parallel.embedding = 'replicate'", "ties its input and output embeddings", "vocab_parallel"],
    ),
    # schedules
    (["parallel.schedule=1F1b"], WORLD, ["parallel.schedule = '1F1b' is unknown", "did you mean '1F1B'"]),
    (
        ["parallel.schedule=ZBVZeroBubble", "parallel.stages_per_rank=1"],
        WORLD,
        ["parallel.stages_per_rank = 1", "needs exactly 2"],
    ),
    (
        ["parallel.pp=1", "parallel.tp=2", "model.tie_embeddings=true", "parallel.embedding=replicate"],
        2,
        ["ties its input and output embeddings"],
    ),
    (["parallel.microbatches=1", "training.batch_size=2"], WORLD, ["parallel.microbatches = 1", "raise"]),
    (["parallel.schedule=missing.csv"], WORLD, ["parallel.schedule = 'missing.csv'", "file not found"]),
    # batch and sequence
    (["training.batch_size=6"], WORLD, ["training.batch_size = 6", "local batch of 3", "multiple of", "= 8"]),
    (
        ["training.batch_size=4", "parallel.dp_replicate=2", "parallel.dp_shard=-1"],
        16,
        ["training.batch_size = 4", "local batch of 1 per DP rank (dp = 4)", "multiple of dp * microbatches = 16"],
    ),
    (["training.seq_len=512"], WORLD, ["training.seq_len = 512 exceeds model.max_seq_len = 256"]),
    # enums
    (["parallel.split=evn"], WORLD, ["parallel.split = 'evn' is not one of", "did you mean 'even'"]),
    (["parallel.mixed_precision=fp16"], WORLD, ["parallel.mixed_precision = 'fp16'", "bf16, fp32"]),
    (["parallel.activation_checkpoint=partial"], WORLD, ["parallel.activation_checkpoint = 'partial'", "selective"]),
    (["parallel.embedding=sharded"], WORLD, ["parallel.embedding = 'sharded'", "vocab_parallel"]),
    (["parallel.fsdp_reshard_after_forward=sometimes"], WORLD, ["parallel.fsdp_reshard_after_forward = 'sometimes'"]),
    (["model.kind=gpt"], WORLD, ["model.kind = 'gpt'", "reference, hf_llama"]),
    (["data.source=web"], WORLD, ["data.source = 'web'", "synthetic, text"]),
    # fsdp reshard group size
    (
        ["parallel.fsdp_reshard_after_forward=3"],
        WORLD,
        ["parallel.fsdp_reshard_after_forward = 3", "dividing parallel.dp_shard = 2"],
    ),
    (["parallel.fsdp_reshard_after_forward=0"], WORLD, ["parallel.fsdp_reshard_after_forward = 0"]),
    # split lists
    (["parallel.split=layers_per_stage"], WORLD, ["needs parallel.layers_per_stage with one entry per stage (2)"]),
    (
        ["parallel.split=layers_per_stage", "parallel.layers_per_stage=[1,3,0]"],
        WORLD,
        ["parallel.layers_per_stage has 3 entries but there are 2 stages"],
    ),
    (
        ["parallel.split=layers_per_stage", "parallel.layers_per_stage=[-1,5]"],
        WORLD,
        ["parallel.layers_per_stage = [-1, 5] has a negative count"],
    ),
    (
        ["parallel.split=layers_per_stage", "parallel.layers_per_stage=[1,2]"],
        WORLD,
        ["parallel.layers_per_stage = [1, 2] sums to 3 but model.n_layers = 4"],
    ),
    (["parallel.split=explicit"], WORLD, ["needs parallel.stage_fqns"]),
    (
        ["parallel.split=explicit", 'parallel.stage_fqns=[["layers.0"]]'],
        WORLD,
        ["parallel.stage_fqns has 1 entries but there are 2 stages"],
    ),
    (["parallel.split=explicit", 'parallel.stage_fqns=[["layers.0"], []]'], WORLD, ["parallel.stage_fqns[1] is empty"]),
    (["parallel.split_embed_weight=-1"], WORLD, ["parallel.split_embed_weight = -1.0 must be >= 0"]),
    (["parallel.split_head_weight=-0.5"], WORLD, ["parallel.split_head_weight = -0.5 must be >= 0"]),
    # data, checkpoint, training
    (["data.source=text"], WORLD, ["data.path = ''", 'data.source = "synthetic"']),
    (["data.source=text", "data.path=/no/such/file.txt"], WORLD, ["data.path = '/no/such/file.txt'"]),
    (["checkpoint.interval=-1"], WORLD, ["checkpoint.interval = -1 must be >= 0"]),
    (["training.steps=0"], WORLD, ["training.steps = 0 must be >= 1"]),
    (["training.lr=0"], WORLD, ["training.lr = 0.0 must be > 0"]),
    (["training.lr=-1e-3"], WORLD, ["training.lr = -0.001 must be > 0"]),
    (["training.warmup_steps=-1"], WORLD, ["training.warmup_steps = -1 must be >= 0"]),
    # override syntax
    (["paralleltp=2"], WORLD, ["override 'paralleltp=2' is not of the form section.key=value"]),
    (["parallel.tp"], WORLD, ["override 'parallel.tp' is not of the form section.key=value"]),
]


@pytest.mark.parametrize(
    "overrides, world_size, fragments", ERROR_CASES, ids=[" ".join(c[0]) or f"ws{c[1]}" for c in ERROR_CASES]
)
def test_invalid_job(base, overrides, world_size, fragments):
    """Config-only rules fail in load_config, model rules in check_job (what every CLI command runs)."""
    message = config_error(lambda: check_job(load_config(base, overrides, world_size=world_size), world_size))
    for fragment in fragments:
        assert fragment in message


def test_bad_csv_schedule(base, tmp_path):
    csv = tmp_path / "one_rank.csv"
    csv.write_text("0F0,0B0\n")
    message = config_error(load_config, base, [f'parallel.schedule="{csv}"'], world_size=WORLD)
    assert "runs 1 stages on 1 ranks" in message and "parallel.pp = 1" in message


ALL_KEYS = [
    (section.name, toml_key(f.name), {})  # a field escaping a Python keyword (`async_`) is its TOML key (`async`)
    for section in dataclasses.fields(JobConfig)
    for f in dataclasses.fields(section.default_factory)
    if f.metadata.get("toml", True)
] + [  # each model kind's own keys (ModelKind.section), given beside its kind
    ("model", f.name, {"kind": name})
    for name, kind in MODEL_KINDS.items()
    if kind.section
    for f in dataclasses.fields(kind.section)
]


@pytest.mark.parametrize("section, key, beside", ALL_KEYS)
def test_every_field_is_type_checked(section, key, beside):
    message = config_error(config_from_dict, {section: {key: {"a": 1}, **beside}}, world_size=1)
    assert message.startswith(f"{section}.{key} = ") and "has type table" in message


def test_section_must_be_a_table():
    assert "parallel = 3 must be a table" in config_error(config_from_dict, {"parallel": 3})


def test_bad_env_world_size(base, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "eight")
    assert "WORLD_SIZE = 'eight' is not an integer" in config_error(load_config, base)


def test_env_world_size_is_checked_against_the_degrees(base, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    assert "cannot fill world size 6" in config_error(load_config, base)


def test_missing_file_names_the_path(tmp_path):
    path = str(tmp_path / "absent.toml")
    assert path in config_error(load_config, path)


def test_malformed_toml_names_the_line(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[parallel]\npp = 2\ntp = = 2\n")
    message = config_error(load_config, str(path))
    assert "not valid TOML" in message and "line 3" in message


def test_resolve_parallel_checks_python_built_configs():
    assert "parallel.tp = 0" in config_error(resolve_parallel, ParallelConfig(tp=0), world_size=1)
    assert 'parallel.tp = "2"' in config_error(resolve_parallel, ParallelConfig(tp="2"), world_size=2)
