"""Launch profiles: TOML loading, extends, --set, the search path, and every user mistake
as a UserError that names the file, the key and the next step. Profiles are written into
temporary directories; the shipped ones are not used here."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sm120kit.errors import UserError
from sm120kit.profiles import loader
from sm120kit.profiles.loader import (
    ENV_VAR,
    list_profiles,
    load_profile,
    profile_schema,
)
from sm120kit.profiles.model import Profile


@pytest.fixture
def pdir(tmp_path: Path, monkeypatch) -> Path:
    """A profile directory; the environment variable unset and the shipped set empty."""
    monkeypatch.delenv(ENV_VAR, raising=False)
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(loader, "shipped_dir", lambda: shipped)
    path = tmp_path / "profiles"
    path.mkdir()
    return path


def write(directory: Path, name: str, text: str) -> Path:
    path = directory / f"{name}.toml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def load(directory: Path, name: str, *sets: str) -> Profile:
    return load_profile(name, [str(directory)], list(sets))


def error(directory: Path, name: str, *sets: str) -> str:
    with pytest.raises(UserError) as info:
        load(directory, name, *sets)
    assert info.value.hint, "every mistake comes with a next step"
    return str(info.value)


BASE = """\
    description = "the node"
    patches = ["p-base"]
    [node]
    gpus = 8
    [engine]
    cuda_graphs = false
    max_running_requests = 64
    [env]
    NCCL_P2P_LEVEL = "SYS"
    [extra_args]
    "--disable-custom-all-reduce" = true
"""


# -- composition -------------------------------------------------------------------------


def test_a_plain_profile_gets_its_name_source_and_defaults(pdir):
    path = write(pdir, "plain", 'description = "x"\n[parallel]\ntp = 8\n')
    profile = load(pdir, "plain")
    assert (profile.name, profile.source, profile.description) == ("plain", str(path), "x")
    assert profile.parallel.tp == 8 and profile.engine.cuda_graphs is True
    assert (profile.server.host, profile.server.port, profile.health.startup_timeout_s) == ("127.0.0.1", 30000, 1800.0)


def test_extends_two_levels_merges_tables_and_replaces_lists(pdir):
    write(pdir, "base", BASE)
    write(
        pdir,
        "mid",
        """\
        extends = "base"
        patches = ["p-mid"]
        [engine]
        max_running_requests = 512
        attention_backend = "flashinfer"
        [env]
        OMP_NUM_THREADS = "8"
    """,
    )
    write(
        pdir,
        "top",
        """\
        extends = "mid"
        description = "top"
        [engine]
        attention_backend = "triton"
    """,
    )
    profile = load(pdir, "top")
    assert profile.description == "top"
    assert profile.extends == "mid"
    assert profile.node.gpus == 8  # from base, two levels up
    assert profile.patches == ["p-mid"]  # lists replace
    assert profile.engine.cuda_graphs is False  # tables merge key by key
    assert profile.engine.max_running_requests == 512
    assert profile.engine.attention_backend == "triton"
    assert profile.env == {"NCCL_P2P_LEVEL": "SYS", "OMP_NUM_THREADS": "8"}
    assert profile.extra_args == {"--disable-custom-all-reduce": True}


def test_a_list_of_extends_applies_in_order_then_the_file(pdir):
    write(pdir, "a", '[engine]\nkv_cache_dtype = "fp8_e4m3"\nattention_backend = "fa"\n[model]\npath = "m-a"\n')
    write(pdir, "b", '[engine]\nkv_cache_dtype = "bf16"\n[parallel]\ntp = 4\n')
    write(pdir, "both", 'extends = ["a", "b"]\n[parallel]\ntp = 8\n')
    profile = load(pdir, "both")
    assert profile.engine.kv_cache_dtype == "bf16"  # b after a
    assert profile.engine.attention_backend == "fa"
    assert profile.model.path == "m-a"
    assert profile.parallel.tp == 8  # the file itself last


def test_a_diamond_is_not_a_cycle(pdir):
    write(pdir, "root", "[parallel]\ntp = 2\n")
    write(pdir, "left", 'extends = "root"\n')
    write(pdir, "right", 'extends = "root"\n[parallel]\npp = 2\n')
    write(pdir, "diamond", 'extends = ["left", "right"]\n')
    profile = load(pdir, "diamond")
    assert (profile.parallel.tp, profile.parallel.pp) == (2, 2)


def test_a_path_to_a_toml_file_loads_with_its_own_directory_for_extends(pdir, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    write(pdir, "base", "[parallel]\ntp = 2\n")
    write(elsewhere, "base", "[parallel]\ntp = 4\n")
    path = write(elsewhere, "mine", 'extends = "base"\n')
    profile = load(pdir, str(path))
    assert (profile.name, profile.parallel.tp) == ("mine", 4)


# -- --set -------------------------------------------------------------------------------


def test_set_overrides_after_extends(pdir):
    write(pdir, "base", BASE)
    write(pdir, "p", 'extends = "base"\n')
    profile = load(
        pdir,
        "p",
        "engine.max_running_requests=2048",  # int
        "engine.cuda_graphs=true",  # bool
        "engine.mem_fraction_static=0.9",  # float
        'model.quantization="modelopt_fp4"',  # a quoted TOML string
        "model.path=/models/GLM-5-NVFP4",  # not TOML: taken as the text
        "model.served_name=2024",  # a string field keeps the text, not the int
        "env.NCCL_DEBUG=INFO",  # a new key of a free table, nested
        "env.OMP_NUM_THREADS=8",
        "extra_args.--enable-metrics=true",
        "health.startup_timeout_s=3600",
        "patches=['x', 'y']",
        "node={gpu_memory_gb = 96}",  # an inline table merges into the table
    )
    assert profile.engine.max_running_requests == 2048
    assert profile.engine.cuda_graphs is True
    assert profile.engine.mem_fraction_static == 0.9
    assert profile.model.quantization == "modelopt_fp4"
    assert profile.model.path == "/models/GLM-5-NVFP4"
    assert profile.model.served_name == "2024"
    assert profile.env == {"NCCL_P2P_LEVEL": "SYS", "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "8"}
    assert profile.extra_args == {"--disable-custom-all-reduce": True, "--enable-metrics": True}
    assert profile.health.startup_timeout_s == 3600.0
    assert profile.patches == ["x", "y"]
    assert (profile.node.gpus, profile.node.gpu_memory_gb) == (8, 96)


def test_later_set_wins(pdir):
    write(pdir, "p", "")
    assert load(pdir, "p", "parallel.tp=2", "parallel.tp=8").parallel.tp == 8


@pytest.mark.parametrize("item", ["engine", "engine.cuda_graphs", "=3", "engine..tp=1", ".tp=1", "engine.=1"])
def test_set_needs_a_dotted_key_and_a_value(pdir, item):
    write(pdir, "p", "")
    message = error(pdir, "p", item)
    assert f"--set {item!r}" in message and "KEY=VALUE" in message and "a.b=value" in message


def test_set_of_a_key_the_model_does_not_have_names_the_nearest(pdir):
    write(pdir, "p", "")
    message = error(pdir, "p", "engine.max_runing_requests=8")
    assert "--set 'engine.max_runing_requests=8'" in message
    assert "did you mean engine.max_running_requests?" in message
    message = error(pdir, "p", "enigne.cuda_graphs=false")
    assert "unknown key enigne" in message and "did you mean engine?" in message
    assert "server.port is a value, not a table" in error(pdir, "p", "server.port.x=1")
    assert "extends cannot be set" in error(pdir, "p", "extends=other")


def test_a_wrong_type_from_set_names_the_set(pdir):
    write(pdir, "p", "")
    message = error(pdir, "p", "engine.cuda_graphs=yes")
    assert '--set engine.cuda_graphs=yes: engine.cuda_graphs: expected true or false, got "yes"' in message


# -- the mistakes ------------------------------------------------------------------------


def test_toml_syntax_error_names_file_line_and_column(pdir):
    path = write(pdir, "bad", "[engine]\ncuda_graphs = false\nattention_backend = flashinfer\n")
    message = error(pdir, "bad")
    assert str(path) in message and "line 3" in message and "column 21" in message


def test_unknown_key_names_file_key_and_nearest(pdir):
    write(pdir, "base", BASE)
    path = write(pdir, "p", 'extends = "base"\n[engine]\nmax_runing_requests = 8\n')
    message = error(pdir, "p")
    assert f"{path}: unknown key engine.max_runing_requests; did you mean engine.max_running_requests?" in message
    assert "rename it to max_running_requests" in message


def test_unknown_key_without_a_near_one_lists_the_valid_ones(pdir):
    write(pdir, "p", "[health]\nzzz = 1\n")
    message = error(pdir, "p")
    assert "unknown key health.zzz" in message and "valid keys under [health]: startup_timeout_s" in message


def test_an_error_names_the_file_that_wrote_the_key(pdir):
    base = write(pdir, "base", "[parallel]\ntp = 0\n")
    write(pdir, "p", 'extends = "base"\n')
    message = error(pdir, "p")
    assert f"{base}: parallel.tp: Input should be greater than or equal to 1 (got 0)" in message


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('[parallel]\ntp = "8"', 'parallel.tp: expected an integer, got "8"'),
        ("[parallel]\ntp = 8.5", "parallel.tp: expected an integer, got 8.5"),
        ("[engine]\ncuda_graphs = 1", "engine.cuda_graphs: expected true or false, got 1"),
        ('[engine]\nmem_fraction_static = "0.9"', 'engine.mem_fraction_static: expected a number, got "0.9"'),
        ("[model]\npath = 3", "model.path: expected a string, got 3"),
        ('patches = "a"', 'patches: expected an array of strings, got "a"'),
        ('patches = ["a", 2]', "patches[1]: expected a string, got 2"),
        ("engine = 3", "engine: expected a table, got 3"),
        ("[env]\nA = 1", "env.A: expected a string, got 1"),
        (
            '[extra_args]\n"--x" = [1]',
            "extra_args.--x: expected a string or an integer or a number or true or false, got [1]",
        ),
    ],
)
def test_wrong_type_names_key_expected_type_and_value(pdir, line, expected):
    path = write(pdir, "p", line + "\n")
    message = error(pdir, "p")
    assert f"{path}: {expected}" in message
    assert message.count(f"{path}: ") == 1, "one problem, reported once (a union reports per member)"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[engine]\nmem_fraction_static = 1.0", "engine.mem_fraction_static: Input should be less than 1"),
        (
            "[engine]\nchunked_prefill_size = 0",
            "engine.chunked_prefill_size: must be a positive number of tokens, or -1",
        ),
        ("[server]\nport = 70000", "server.port: Input should be less than or equal to 65535"),
        ("[parallel]\nnnodes = 2\nnode_rank = 2", "parallel.node_rank = 2 must be less than parallel.nnodes = 2"),
        ('sglang = "0.5.9"', "sglang: '0.5.9' is not a PEP 440 version range"),
        ('[env]\n"NOT A NAME" = "1"', "env: 'NOT A NAME' is not an environment variable name"),
        ("[extra_args]\nenable-metrics = true", 'keys must be flags that start with "--"'),
        ('[server]\napi_key_env = "sk-live-123"', "server.api_key_env: must be the NAME of an environment variable"),
        (
            "[health]\nbackoff_initial_s = 60\nbackoff_max_s = 30",
            "health.backoff_max_s = 30.0 is less than health.backoff_initial_s = 60.0",
        ),
        ("extends = 3", "extends: expected a profile name or a list of names, got 3"),
        ('name = "x"', "unknown key name (name is set by sm120kit)"),
    ],
)
def test_invalid_values(pdir, text, expected):
    write(pdir, "p", text + "\n")
    assert expected in error(pdir, "p")


def test_every_problem_is_reported_at_once(pdir):
    write(pdir, "p", '[parallel]\ntp = 0\npp = "2"\n[engine]\ncuda_graph = false\n')
    message = error(pdir, "p")
    assert "parallel.tp" in message and "parallel.pp" in message and "engine.cuda_graph;" in message
    assert "(and 2 more above)" in message


def test_ok_values_at_the_edges(pdir):
    write(
        pdir,
        "p",
        "[engine]\nchunked_prefill_size = -1\nmem_fraction_static = 0.95\n[parallel]\nnnodes = 2\nnode_rank = 1\n",
    )
    profile = load(pdir, "p")
    assert (profile.engine.chunked_prefill_size, profile.parallel.node_rank) == (-1, 1)


def test_unknown_profile_lists_the_known_names(pdir):
    write(pdir, "glm5-nvfp4", "")
    write(pdir, "sm120-base", "")
    message = error(pdir, "glm5-nvpf4")
    assert "unknown profile 'glm5-nvpf4'; did you mean 'glm5-nvfp4'?" in message
    assert "known: glm5-nvfp4, sm120-base" in message and "--profile-dir" in message


def test_unknown_extends_target(pdir):
    path = write(pdir, "p", 'extends = ["sm120-bsae"]\n')
    write(pdir, "sm120-base", "")
    message = error(pdir, "p")
    assert f"{path}: extends: unknown profile 'sm120-bsae'; did you mean 'sm120-base'?" in message


def test_extends_cycle_shows_the_chain(pdir):
    write(pdir, "a", 'extends = "b"\n')
    write(pdir, "b", 'extends = "a"\n')
    assert "extends cycle: a -> b -> a" in error(pdir, "a")
    write(pdir, "c", 'extends = ["x", "c"]\n')
    write(pdir, "x", "")
    assert "extends cycle: c -> c" in error(pdir, "c")
    write(pdir, "d", 'extends = "e"\n')
    write(pdir, "e", 'extends = "f"\n')
    write(pdir, "f", 'extends = "e"\n')
    assert "extends cycle: e -> f -> e" in error(pdir, "d")


def test_a_file_that_is_not_utf8(pdir):
    (pdir / "p.toml").write_bytes(b'description = "\xff"\n')
    assert "not UTF-8" in error(pdir, "p")


# -- the public-bind rule ----------------------------------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "gpu-node-1.example.com"])
def test_a_public_bind_needs_an_api_key(pdir, host):
    write(pdir, "p", f'[server]\nhost = "{host}"\n')
    message = error(pdir, "p")
    assert f"server.host = {host!r} is a public bind without an API key" in message
    assert "server.api_key_env" in message and "server.allow_public_without_key = true" in message
    assert load(pdir, "p", "server.api_key_env=SGLANG_API_KEY").server.api_key_env == "SGLANG_API_KEY"
    assert load(pdir, "p", "server.allow_public_without_key=true").server.host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"])
def test_a_loopback_bind_needs_no_key(pdir, host):
    write(pdir, "p", f'[server]\nhost = "{host}"\n')
    assert load(pdir, "p").server.api_key_env is None


# -- the JSON Schema ---------------------------------------------------------------------


def test_the_schema_describes_every_field_and_forbids_extra_keys():
    schema = profile_schema()
    assert schema["$schema"].startswith("https://json-schema.org/")
    assert schema["title"] == "sm120kit launch profile"
    tables = [schema, *schema["$defs"].values()]
    assert {t["title"] for t in schema["$defs"].values()} >= {"Node", "Model", "Parallel", "Engine", "Server", "Health"}
    for table in tables:
        assert table["additionalProperties"] is False, table["title"]
        for key, prop in table["properties"].items():
            assert prop.get("description"), f"{table['title']}.{key} has no description"
    assert "name" not in schema["properties"] and "source" not in schema["properties"]
    assert schema["properties"]["extra_args"]["description"].startswith("Other sglang flags")
    assert "max_running_requests" in schema["$defs"]["Engine"]["properties"]


# -- where profiles are found ------------------------------------------------------------


def test_search_path_profile_dir_then_env_then_shipped(tmp_path, monkeypatch):
    dirs = {k: tmp_path / k for k in ("cli", "env1", "env2", "shipped")}
    for d in dirs.values():
        d.mkdir()
        write(d, "same", f'description = "from {d.name}"\n')
    write(dirs["env2"], "env-only", 'description = "env2"\n')
    write(dirs["shipped"], "env-only", 'description = "shipped"\n')
    write(dirs["shipped"], "shipped-only", 'description = "shipped"\n')
    monkeypatch.setattr(loader, "shipped_dir", lambda: dirs["shipped"])
    monkeypatch.setenv(ENV_VAR, f"{dirs['env1']}{__import__('os').pathsep}{dirs['env2']}")

    assert load_profile("same", [str(dirs["cli"])]).description == "from cli"
    assert load_profile("same").description == "from env1"
    assert load_profile("env-only").description == "env2"
    assert load_profile("shipped-only").source == str(dirs["shipped"] / "shipped-only.toml")
    rows = list_profiles([str(dirs["cli"])])
    assert [(n, d) for n, _, d in rows] == [("env-only", "env2"), ("same", "from cli"), ("shipped-only", "shipped")]
    assert rows[1][1] == dirs["cli"] / "same.toml"

    monkeypatch.delenv(ENV_VAR)
    assert load_profile("same").description == "from shipped"
    # extends resolves through the same path: a user base replaces the shipped base
    write(dirs["shipped"], "child", 'extends = "same"\n')
    assert load_profile("child", [str(dirs["cli"])]).description == "from cli"


def test_a_missing_profile_dir_is_an_error(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    with pytest.raises(UserError, match=r"profile directory .* does not exist"):
        list_profiles([str(tmp_path / "nope")])
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "nope"))
    with pytest.raises(UserError, match=f"\\${ENV_VAR}"):
        load_profile("x")


def test_a_broken_file_is_listed_with_the_reason(pdir):
    write(pdir, "ok", 'description = "fine"\n')
    write(pdir, "broken", "description = \n")
    rows = {name: description for name, _, description in list_profiles([str(pdir)])}
    assert rows["ok"] == "fine"
    assert rows["broken"].startswith("(cannot be read:") and "line 1" in rows["broken"]


def test_the_shipped_dir_is_the_checkout_profiles_dir_or_the_packaged_one():
    shipped = loader.shipped_dir()
    assert shipped.name == "profiles" and shipped.parent.name in (
        "_shipped",
        Path(__file__).resolve().parent.parent.name,
    )


# -- fuzz: anything the user types is a Profile or a UserError -----------------------------

TOML_BITS = [
    "\n",
    " = ",
    "=",
    ".",
    ",",
    "[",
    "]",
    "{",
    "}",
    '"',
    "'",
    "#",
    "[engine]\n",
    "[server]\n",
    "[parallel]\n",
    "[env]\n",
    "[extra_args]\n",
    "[[patches]]\n",
    "extends",
    "patches",
    "tp",
    "host",
    "port",
    "cuda_graphs",
    "max_running_requests",
    "mem_fraction_static",
    "api_key_env",
    "node_rank",
    "nnodes",
    '"--x"',
    '"0.0.0.0"',
    '"fuzz"',
    '"base"',
    '["base", "fuzz"]',
    "8",
    "-1",
    "0",
    "0.5",
    "1e400",
    "nan",
    "true",
    "1979-05-27",
    '"""',
]
KEYS = [
    "engine.max_running_requests",
    "engine.cuda_graphs",
    "server.host",
    "parallel.tp",
    "env.X",
    "extra_args.--x",
    "extends",
    "node",
    "engine",
    "engine.max_runing_requests",
    "a..b",
    "",
    "patches",
    "server.port.x",
]
TABLES = ["", "engine", "server", "parallel", "node", "model", "health", "env", "extra_args", "engine.x", "nope"]
NAMES = [
    "extends",
    "patches",
    "tp",
    "nnodes",
    "node_rank",
    "host",
    "port",
    "api_key_env",
    "allow_public_without_key",
    "cuda_graphs",
    "max_running_requests",
    "mem_fraction_static",
    "chunked_prefill_size",
    "sglang",
    "name",
    "description",
    '"--x"',
    "X",
    "gpus",
    "engine",
    "max_runing_requests",
    "backoff_max_s",
]
LITERALS = [
    "8",
    "0",
    "-1",
    "0.9",
    "1e400",
    "nan",
    "true",
    '"0.0.0.0"',
    '"K"',
    '"base"',
    '"fuzz"',
    '["base"]',
    '["a", 2]',
    '">=0.5.9"',
    '"=bad"',
    "{ a = 1 }",
    "1979-05-27",
    "[]",
]
# Mostly valid TOML made of the model's own keys (so validation runs), or TOML-ish garbage.
DOCUMENTS = (
    st.lists(
        st.tuples(
            st.sampled_from(TABLES),
            st.lists(
                st.tuples(st.sampled_from(NAMES), st.sampled_from(LITERALS)), max_size=4, unique_by=lambda kv: kv[0]
            ),
        ),
        max_size=5,
        unique_by=lambda table: table[0],
    )
    .map(lambda tables: sorted(tables, key=lambda table: table[0] != ""))
    .map(lambda tables: "".join((f"[{t}]\n" if t else "") + "".join(f"{k} = {v}\n" for k, v in kv) for t, kv in tables))
)
GARBAGE = st.lists(st.sampled_from(TOML_BITS) | st.text(max_size=4), max_size=30).map("".join)
VALUES = ["8", "true", "0.9", '"x"', "[1, 2]", "{gpus = 2}", "0.0.0.0", "", "=", "nan", "1\nx = 2", "[[", "-1"]


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=DOCUMENTS | GARBAGE,
    sets=st.lists(
        st.builds(
            lambda k, v: f"{k}={v}",
            st.sampled_from(KEYS) | st.text(max_size=8),
            st.sampled_from(VALUES) | st.text(max_size=8),
        )
        | st.text(max_size=12),
        max_size=3,
    ),
)
def test_fuzz_returns_a_profile_or_a_user_error(pdir, text, sets):
    write(pdir, "base", "[parallel]\ntp = 2\n")
    (pdir / "fuzz.toml").write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        profile = load_profile("fuzz", [str(pdir)], sets)
    except UserError as exc:
        assert exc.message and exc.hint
    else:
        assert isinstance(profile, Profile) and profile.name == "fuzz"


# -- every number is finite and bounded (issue 12, item 8) -------------------------------


def numeric_fields() -> list[tuple[str, str, type]]:
    """(table, key, int or float) of every number in a profile, found from the model itself."""
    from typing import get_args

    from pydantic import BaseModel

    found = []
    for table, info in Profile.model_fields.items():
        if not (isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)):
            continue
        for key, field in info.annotation.model_fields.items():
            kinds = {
                info_type for info_type in (field.annotation, *get_args(field.annotation)) if info_type in (int, float)
            }
            if kinds:
                found.append((table, key, float if float in kinds else int))
    return found


def test_the_model_has_numbers_to_check():
    keys = {f"{t}.{k}" for t, k, _ in numeric_fields()}
    assert {
        "health.stop_timeout_s",
        "health.startup_timeout_s",
        "parallel.tp",
        "server.port",
        "engine.mem_fraction_static",
    } <= keys


@pytest.mark.parametrize(("table", "key", "kind"), numeric_fields())
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e300", "-7", "123456789012345678901234567890"])
def test_every_number_is_finite_and_bounded(pdir, table, key, kind, value):
    if kind is int and value == "1e300":
        value = "10000000000000000000"  # TOML's largest integers: the int spelling of "absurdly large"
    path = write(pdir, "p", f"[{table}]\n{key} = {value}\n")
    message = error(pdir, "p")
    assert f"{path}: {table}.{key}" in message, message
    assert "allowed:" in message or "must be" in message, f"the message names the allowed range: {message}"
    assert "Infinity" not in message and "NaN" not in message, "values are spelled as TOML spells them"


def test_the_range_is_named_with_the_value(pdir):
    path = write(pdir, "p", "[health]\nstop_timeout_s = inf\n")
    message = error(pdir, "p")
    assert f"{path}: health.stop_timeout_s: inf is not a finite number" in message
    assert "allowed: a number above 0 and at most 86400" in message
    message = error(pdir, "p", "health.stop_timeout_s=1e9")
    assert "--set health.stop_timeout_s=1e9: health.stop_timeout_s" in message and "at most 86400" in message
    message = error(pdir, "p", "health.stop_timeout_s=60", "parallel.tp=100000")
    assert "parallel.tp" in message and "allowed: an integer from 1 to 1024" in message


def test_non_finite_extra_args_values_are_refused(pdir):
    path = write(pdir, "p", '[extra_args]\n"--x" = nan\n')
    assert f"{path}: extra_args.--x: nan is not a finite number" in error(pdir, "p")


# -- extra_args may not undo what a field guards (issue 12, item 11) ----------------------


@pytest.mark.parametrize(
    ("flag", "value", "field"),
    [
        ("--host", '"0.0.0.0"', "server.host"),
        ("--port", "8000", "server.port"),
        ("--api-key", '"sk-live-123"', "server.api_key_env"),
        ("--model-path", '"/models/x"', "model.path"),
        ("--model", '"/models/x"', "model.path"),
        ("--tp-size", "4", "parallel.tp"),
        ("--tensor-parallel-size", "4", "parallel.tp"),
        ("--ep", "8", "parallel.ep"),
        ("--kv-cache-dtype", '"fp8_e4m3"', "engine.kv_cache_dtype"),
        ("--disable-cuda-graph", "true", "engine.cuda_graphs"),
        ("--config", '"other.yaml"', "server.api_key_env"),
    ],
)
def test_extra_args_may_not_set_a_flag_that_a_field_owns(pdir, flag, value, field):
    path = write(pdir, "p", f'[extra_args]\n"--enable-metrics" = true\n"{flag}" = {value}\n')
    message = error(pdir, "p")
    assert f"{path}: extra_args.{flag}: " in message and field in message, message
    assert "sk-live-123" not in message, "a key written where it does not belong is not echoed"
    assert f"set {field} instead" in message, message


def test_extra_args_set_on_the_command_line_is_refused_the_same_way(pdir):
    write(pdir, "p", "")
    message = error(pdir, "p", "extra_args.--host=0.0.0.0")
    assert "--set extra_args.--host=0.0.0.0: extra_args.--host: " in message and "server.host" in message
    message = error(pdir, "p", "extra_args.--api-key=sk-live-123")
    assert "--set extra_args.--api-key=***: extra_args.--api-key: " in message and "sk-live-123" not in message
    assert load(pdir, "p", "extra_args.--enable-metrics=true").extra_args == {"--enable-metrics": True}


def test_extra_args_may_not_carry_the_admin_key(pdir):
    """sglang's --admin-api-key has no field: in argv every user of the machine reads it."""
    path = write(pdir, "p", '[extra_args]\n"--admin-api-key" = "hunter2hunter2"\n')
    message = error(pdir, "p")
    assert (
        f"{path}: extra_args.--admin-api-key: --admin-api-key carries a secret" in message
        and "hunter2hunter2" not in message
    )
    assert "remove --admin-api-key from [extra_args]" in message and "and set" not in message
