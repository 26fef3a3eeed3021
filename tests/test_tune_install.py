"""tune-moe's tables installed as tracked changes, on real sglang releases (the MoE layers of
the wheel unpacked): each table is written where the release's own get_moe_configs (read
from the installed file and run with stand-ins, sm120kit/tune/lookup.py) loads it first, and
that function returns exactly the table; `status` lists it with what it was tuned for;
`unpatch` gives back the tree byte for byte, a file of sglang's that a table replaced
included; an upgrade is noticed; a foreign edit is refused; $SGLANG_MOE_CONFIG_DIR keeps
sglang's own tables for the GPU in reach; a kill at any step loses nothing; hostile
entries are damage.

Releases: 0.5.9 (fused_moe_triton/, a fixed list of Triton versions to fall back to),
0.5.12.post1 (moe_runner/triton_utils/, every triton_* directory newest-first, and a
failure when $SGLANG_MOE_CONFIG_DIR has no configs/), 0.5.23 (ships tables for the RTX PRO
6000 Server Edition, E=256,N=512, in triton_3_6_0)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
from support.sites import MEMBERS, wheel_bytes
from support.tune import KIMI_K2_FP8_TP8 as KIMI
from support.tune import MOE, SERVER, TRITON, configs, meta, release, set_triton

from sm120kit import wheels
from sm120kit.cli import main
from sm120kit.errors import UserError
from sm120kit.target import resolve_target
from sm120kit.tune.install import (
    Table,
    TuneMeta,
    install_table,
    install_tables,
    table_bytes,
)
from sm120kit.tune.installed import installed_tables
from sm120kit.tune.lookup import (
    CONFIG_DIR_ENV,
    LookupFailed,
    config_destination,
    config_file_name,
    config_module,
    server_env_problem,
    table_for_device,
    what_sglang_loads,
)
from sm120kit.tune.shape import MoeShape

MAX_Q = "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition"
# The shape 0.5.23 ships this GPU's tables for (configs/triton_3_6_0/E=256,N=512,device_name=...).
SHIPPED = MoeShape(256, 4096, 512, 512, 8, None, model="E=256,N=512")


@pytest.fixture(autouse=True)
def no_config_dir_here(monkeypatch):
    """The machine's own $SGLANG_MOE_CONFIG_DIR is not the tests' (status reads it)."""
    monkeypatch.delenv(CONFIG_DIR_ENV, raising=False)


def files(root: Path) -> dict[str, str]:
    """Every file and directory outside the state directory: digests, and "dir"."""
    return {
        str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if ".sm120kit" not in p.relative_to(root).parts
    }


def ledger_schema(site: Path) -> int:
    return json.loads((site / ".sm120kit" / "ledger.json").read_text())["schema"]


def shipped_shapes(sglang, device: str) -> list[tuple[MoeShape, bool, Path]]:
    """(shape, down, file) of each table the release ships for this GPU, read from the names."""
    found = []
    for f in sorted((config_module(sglang)[1].parent / "configs").glob("triton_*/*.json")):
        if not table_for_device(f.name, device):
            continue
        m = re.fullmatch(
            r"E=(\d+),N=(\d+),device_name=[^,]+?(?:,dtype=([^,]+?))?(?:,block_shape=\[(\d+), (\d+)\])?"
            r"(,per_channel_quant=True)?(_down)?\.json",
            f.name.replace(device.replace(" ", "_"), "GPU"),
        )
        block = (int(m[4]), int(m[5])) if m[4] else None
        shape = MoeShape(int(m[1]), 1, int(m[2]), int(m[2]), 8, m[3], block, bool(m[6]))
        found.append((shape, bool(m[7]), f))
    return found


@pytest.mark.parametrize("version", ["0.5.9", "0.5.12.post1", "0.5.23"])
def test_written_where_the_release_loads_it_and_taken_out_again(version, site, cli):
    target = release(site, version)
    sglang = target.find("sglang")
    module_relpath, module = config_module(sglang)
    assert module.read_bytes() == wheel_bytes(version, module_relpath)  # the code that runs is the wheel's
    for _shape, _down, f in shipped_shapes(sglang, SERVER) + shipped_shapes(sglang, MAX_Q):
        # the bytes sglang's tuner and its shipped tables have: table_bytes of what the lookup reads
        assert table_bytes({int(m): c for m, c in json.loads(f.read_bytes()).items()}) == f.read_bytes(), f
    tables = [
        Table(configs(1), meta(version, KIMI)),
        Table(configs(2), meta(version, KIMI, down=True)),
        Table(configs(3, (1, 2, 4, 8, 4096)), meta(version, SHIPPED)),
    ]
    keys = [(t.meta.shape, t.meta.down) for t in tables]
    before = {k: what_sglang_loads(sglang, k[0], SERVER, TRITON, down=k[1]) for k in keys}
    vendor = files(site)

    result = install_tables(target, tables)

    for table, installed in zip(tables, result.tables):
        shape, down = table.meta.shape, table.meta.down
        dest = config_destination(sglang, shape, SERVER, TRITON, down=down)
        assert dest.name == config_file_name(sglang, shape, SERVER, down=down)
        assert dest.parent == Path(os.path.realpath(module.parent)) / "configs" / "triton_3_6_0"
        assert installed.path.resolve() == dest and dest.read_bytes() == table_bytes(table.configs)
        loaded = what_sglang_loads(sglang, shape, SERVER, TRITON, down=down)
        assert loaded.path == dest and loaded.table == table.configs and not loaded.fallback
    if version == "0.5.23":  # the table took the place of sglang's own one
        assert before[(SHIPPED, False)].path == config_destination(sglang, SHIPPED, SERVER, TRITON)
        assert result.tables[2].entry.vendor_sha256 == vendor[str(before[(SHIPPED, False)].path.relative_to(site))]
    else:
        assert before == dict.fromkeys(keys)
    assert ledger_schema(site) == 2

    code, doc = cli.json("status", "--site", site)
    rows = {(r["shape"]["experts"], r["down"]): r for r in doc["tuned"]}
    assert set(rows) == {(384, False), (384, True), (256, False)}
    for r, table in zip((rows[(384, False)], rows[(384, True)], rows[(256, False)]), tables):
        assert (r["sglang_version"], r["triton_version"], r["device_name"]) == (version, TRITON, SERVER)
        assert r["batch_sizes"] == sorted(table.configs) and r["state"] == "installed" and not r["stale"]
        assert r["shape"]["dtype"] == table.meta.shape.dtype and r["tuned_at"] and r["profile"] == "kimi-k2-fp8"
        assert r["loaded_by_sglang"] == r["path"] and f"sglang {version} loads it" in r["note"]
    code, out, _ = cli("status", "--site", site, "--wide")  # one line a table
    [line] = [x for x in out.splitlines() if x.startswith("E=384,N=256,dtype=fp8_w8a8,block_shape=[128, 128]_down ")]
    assert re.split(r"\s{2,}", line)[1:6] == [
        "tuned",
        version,
        TRITON,
        doc["tuned"][0]["tuned_at"][:10],
        "installed",
    ], line

    code, out, err = cli("unpatch", "--site", site)
    assert code == 0 and out.count("tune-moe") == 3, out + err
    assert files(site) == vendor  # every file byte for byte, and no directory left behind
    assert {k: what_sglang_loads(sglang, k[0], SERVER, TRITON, down=k[1]) for k in keys} == before
    assert not (site / ".sm120kit").exists() and installed_tables(target) == []  # nothing left to restore


def test_an_upgrade_is_noticed_and_verify_says_to_retune(site, cli):
    """0.5.10.post1 -> 0.5.11 moved the lookup (and its configs/) to moe_runner/triton_utils/:
    the table stays where pip leaves it (no RECORD row names it), and sglang stops loading it."""
    target = release(site, "0.5.10.post1")
    [table] = install_table(target, configs(1), meta("0.5.10.post1", KIMI)).tables
    assert not cli.json("status", "--site", site)[1]["tuned"][0]["stale"]

    set_triton(site, "3.7.1")  # pip install -U triton
    code, doc = cli.json("status", "--site", site)
    [row] = doc["tuned"]
    retune = "re-run `sm120kit tune-moe kimi-k2-fp8 --python EXE`"  # a site has no python to time: the user names one
    said = f"tuned for sglang 0.5.10.post1 / Triton 3.6.0; installed is sglang 0.5.10.post1 / Triton 3.7.1: {retune}"
    assert row["stale"] and row["note"] == said and row["state"] == "installed"

    wheels.install(site, "sglang", "0.5.11", [*MEMBERS, MOE])  # pip install -U sglang
    sglang = resolve_target(site=str(site)).find("sglang")
    assert table.path.read_bytes() == table_bytes(configs(1))
    assert what_sglang_loads(sglang, KIMI, SERVER, "3.7.1") is None  # 0.5.11 looks elsewhere
    code, doc = cli.json("status", "--site", site)
    assert doc["tuned"][0]["note"] == said.replace("installed is sglang 0.5.10.post1", "installed is sglang 0.5.11")
    code, out, err = cli("patch", "--verify", "--site", site, "--wide")
    said = said.replace("installed is sglang 0.5.10.post1", "installed is sglang 0.5.11")
    assert code == 0 and f"tuned MoE config {table.path.name}: {said}" in out, out + err

    code, out, err = cli("unpatch", "--site", site)
    assert code == 0 and not table.path.exists() and not table.path.parent.exists(), out + err


def test_a_foreign_edit_is_refused_and_force_restores_sglangs_file(site, cli):
    target = release(site, "0.5.23", patches=True)
    vendor = files(site)
    assert cli("patch", "--site", site)[0] == 0
    assert ledger_schema(site) == 1  # without tables, a ledger an older sm120kit reads
    [table] = install_table(target, configs(3), meta("0.5.23", SHIPPED)).tables
    relpath = str(table.path.relative_to(site))
    with table.path.open("a") as fh:
        fh.write(" ")  # someone's edit
    edited = {**files(site), ".sm120kit/ledger.json": (site / ".sm120kit" / "ledger.json").read_bytes()}
    code, doc = cli.json("status", "--site", site)
    assert doc["tuned"][0]["state"] == "foreign-edit"
    code, out, err = cli("patch", "--verify", "--site", site)
    assert code == 2 and "the bytes on disk are not the ones sm120kit recorded" in err, out + err
    code, out, err = cli("unpatch", "--site", site, "--wide")
    assert code == 2 and "foreign-edit" in out and "pass --force" in out, out + err
    assert {**files(site), ".sm120kit/ledger.json": (site / ".sm120kit" / "ledger.json").read_bytes()} == edited
    code, out, err = cli("unpatch", "--site", site, "--force")
    assert code == 0 and (site / relpath).read_bytes() == wheel_bytes("0.5.23", relpath), out + err
    assert files(site) == vendor

    # A file that is neither sglang's nor ours where a table goes (sglang's own tuning script
    # put it there): refused, nothing written; with force, unpatch puts it back.
    dest = config_destination(target.find("sglang"), KIMI, SERVER, TRITON)
    dest.write_bytes(b'{"1": {}}\n')
    theirs = files(site)
    with pytest.raises(UserError, match=re.escape("neither sglang's (RECORD) nor the table sm120kit last wrote")):
        install_table(target, configs(1), meta("0.5.23", KIMI))
    assert files(site) == theirs
    install_table(target, configs(1), meta("0.5.23", KIMI), force=True)
    assert cli("unpatch", "--site", site)[0] == 0 and files(site) == theirs


@pytest.mark.parametrize("version, device", [("0.5.9", MAX_Q), ("0.5.23", SERVER)])
def test_a_config_dir_keeps_sglangs_own_tables_in_reach(version, device, site, tmp_path, cli):
    target = release(site, version)
    sglang = target.find("sglang")
    config_dir = tmp_path / "moe-configs"
    config_dir.mkdir()
    env = {CONFIG_DIR_ENV: str(config_dir)}
    if version == "0.5.23":  # 0.5.12+ lists <dir>/configs on a miss: the server would fail
        with pytest.raises(LookupFailed, match=f"No such file or directory: '{config_dir}/configs'"):
            what_sglang_loads(sglang, KIMI, device, TRITON, env)
    else:  # up to 0.5.11 it only tries a fixed list of paths
        assert what_sglang_loads(sglang, KIMI, device, TRITON, env) is None
    vendor = files(site)
    with pytest.raises(UserError, match="not an absolute path"):
        install_table(target, configs(1), meta(version, KIMI, device=device), config_dir=Path("moe-configs"))

    result = install_table(target, configs(1), meta(version, KIMI, device=device), config_dir=config_dir)

    assert result.server_env == env and files(site) == vendor  # the package is untouched
    loaded = what_sglang_loads(sglang, KIMI, device, TRITON, env)
    assert loaded.path == config_dir / "configs" / "triton_3_6_0" / loaded.path.name
    assert loaded.table == configs(1) and what_sglang_loads(sglang, KIMI, device, TRITON) is None
    shipped = shipped_shapes(sglang, device)
    assert len(shipped) == len(result.copied) >= 2
    for shape, down, _file in shipped:  # every lookup of this GPU finds what it found in the package
        in_package = what_sglang_loads(sglang, shape, device, TRITON, down=down)
        in_config_dir = what_sglang_loads(sglang, shape, device, TRITON, env, down=down)
        assert (in_config_dir and in_config_dir.table, in_config_dir and in_config_dir.path.name) == (
            in_package and in_package.table,
            in_package and in_package.path.name,
        )
    assert what_sglang_loads(sglang, MoeShape(7, 8, 9, 9, 1, None), device, "3.9.0", env) is None  # no failure

    assert server_env_problem(env, config_dir) is None
    assert f"does not set {CONFIG_DIR_ENV}" in server_env_problem({}, config_dir)
    assert "would not read tables installed in the package" in server_env_problem(env, None)

    code, doc = cli.json("status", "--site", site)  # found through the target's ledger, no env needed
    kinds = sorted(r["kind"] for r in doc["tuned"] if r["config_dir"] == str(config_dir))
    assert kinds == ["shipped"] * len(shipped) + ["tuned"], doc["tuned"]
    config_dir.rename(tmp_path / "unmounted")  # a volume not mounted: said, not an error
    code, doc = cli.json("status", "--site", site)
    assert doc["tuned"] == [] and doc["tuned_notes"] == [
        f"{config_dir}: the MoE config dir is not there (a volume not mounted?)"
    ]
    (tmp_path / "unmounted").rename(config_dir)
    code, out, err = cli("unpatch", "--site", site)
    assert code == 0 and f"{config_dir} holds no MoE config tables now" in err, out + err
    assert not [p for p in config_dir.rglob("*.json") if ".sm120kit" not in p.parts]
    assert (config_dir / "configs").is_dir() and files(site) == vendor
    assert cli.json("status", "--site", site)[1]["tuned"] == []


def test_bad_input_writes_nothing(site):
    target = release(site, "0.5.23")
    vendor = files(site)
    cases = [
        (Table(configs(1), meta("0.5.22", KIMI)), "tuned for sglang 0.5.22 / Triton 3.6.0, but sglang 0.5.23"),
        (Table(configs(1), TuneMeta(KIMI, "0.5.23", "3.5.1", SERVER, "kimi")), "re-run `sm120kit tune-moe kimi`"),
    ]
    for table, says in cases:
        with pytest.raises(UserError, match=re.escape(says)):
            install_tables(target, [table])
    with pytest.raises(ValueError, match="lacks BLOCK_SIZE_M"):
        install_table(target, {1: {"num_warps": 4}}, meta("0.5.23", KIMI))
    assert files(site) == vendor and not (site / ".sm120kit" / "ledger.json").exists()


def killed(site: Path, run, kill_after: int | None) -> int:
    """run() in a forked child that SIGKILLs itself after its `kill_after`-th fsync or rename
    under `site` (as tests/test_crash_consistency.py does for patch). Returns the exit status
    (-9 when killed) or, with kill_after None, the number of steps."""
    pid = os.fork()
    if pid == 0:  # the child: never returns to pytest
        steps, code = [0], 0
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            real_fsync, real_replace = os.fsync, os.replace

            def step(path) -> None:
                if str(path).startswith(str(site)):
                    steps[0] += 1
                    if steps[0] == kill_after:
                        os.kill(os.getpid(), signal.SIGKILL)

            def fsync(fd):
                real_fsync(fd)
                if not os.path.isdir(f"/proc/self/fd/{fd}"):
                    step(os.readlink(f"/proc/self/fd/{fd}"))

            def replace(src, dst, **kw):
                real_replace(src, dst, **kw)
                step(dst)

            os.fsync, os.replace = fsync, replace
            run()
            code = steps[0] if kill_after is None else 0
        except BaseException:
            code = 255
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


@pytest.mark.parametrize("step", ["install", "unpatch"])
def test_a_kill_at_any_step_loses_nothing(step, tmp_path, cli):
    """Two tables, one new and one in the place of sglang's own: killed at every durable step
    of their install (or of the unpatch that takes them out), each file is whole, and the
    next `unpatch` gives back the vendor's tree with nothing left over."""
    vendor_site = tmp_path / "vendor" / "site-packages"
    vendor_site.mkdir(parents=True)
    release(vendor_site, "0.5.23")
    vendor = files(vendor_site)
    tables = [Table(configs(1), meta("0.5.23", KIMI)), Table(configs(3), meta("0.5.23", SHIPPED))]
    template = tmp_path / "tuned" / "site-packages"
    shutil.copytree(vendor_site, template)
    install_tables(resolve_target(site=str(template)), tables)
    start = vendor_site if step == "install" else template

    def fresh() -> Path:
        site = tmp_path / "run" / "site-packages"
        shutil.rmtree(site.parent, ignore_errors=True)
        shutil.copytree(start, site)
        return site

    def run(site: Path):
        if step == "install":
            return lambda: install_tables(resolve_target(site=str(site)), tables)
        return lambda: main(["unpatch", "--site", str(site)])

    sglang = resolve_target(site=str(template)).find("sglang")
    written = {
        config_destination(sglang, t.meta.shape, SERVER, TRITON).relative_to(template.resolve()): table_bytes(t.configs)
        for t in tables
    }
    site = fresh()
    total = killed(site, run(site), None)
    assert total >= 4 * len(tables)  # a backup or a replace per file at least, the journal and the ledger
    for n in range(1, total + 1):
        site = fresh()
        assert killed(site, run(site), n) == -signal.SIGKILL, n
        for rel, data in written.items():  # each file whole: its old bytes (or none), or the table
            old = (vendor_site / rel).read_bytes() if (vendor_site / rel).exists() else None
            assert ((site / rel).read_bytes() if (site / rel).exists() else None) in (old, data), n
        code, out, err = cli("unpatch", "--site", site)
        assert code == 0, f"killed after step {n} of {total}: {out}{err}"
        assert files(site) == vendor, f"killed after step {n} of {total}"
        assert not list(site.rglob("*.sm120kit-tmp")) and not (site / ".sm120kit" / "journal.json").exists()
        assert not list((site / ".sm120kit" / "backups").glob("*")), n


@pytest.fixture
def tuned(site):
    target = release(site, "0.5.23")
    install_table(target, configs(1), meta("0.5.23", KIMI))
    return site


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda e: e.update(path="../outside/victim.json"), "leaves (or does not name a file in) the target"),
        (lambda e: e.update(path="sglang/srt/models/deepseek_v2.py"), "is no place for a MoE config table"),
        (lambda e: e.update(root="config-dir"), "is no place for a MoE config table"),
        (lambda e: e.update(written_sha256="../../etc/passwd"), "written_sha256: String should match pattern"),
    ],
)
def test_hostile_tuned_entries_are_damage(tuned, tmp_path, cli, damage, says):
    ledger = tuned / ".sm120kit" / "ledger.json"
    doc = json.loads(ledger.read_text())
    [entry] = doc["tuned"].values()
    damage(entry)
    doc["tuned"] = {f"sglang:{entry['path']}": entry}
    ledger.write_text(json.dumps(doc))
    before = files(tuned)
    code, out, err = cli("unpatch", "--site", tuned)
    assert code == 2 and "the sm120kit ledger is damaged" in err and says in err, err
    assert files(tuned) == before and "Traceback" not in out + err


def test_a_symbolic_link_does_not_lead_a_removal_out(tuned, tmp_path, cli):
    """The table's triton_3_6_0/ replaced by a link to a directory outside, holding a file
    with the bytes sm120kit wrote: unpatch says the ledger is damaged and deletes nothing."""
    [table] = installed_tables(resolve_target(site=str(tuned)))
    outside = tmp_path / "outside"
    shutil.move(table.path.parent, outside)
    table.path.parent.symlink_to(outside)
    before = sorted(os.listdir(outside))
    code, out, err = cli("unpatch", "--site", tuned)
    assert code == 2 and "outside" in err and "damaged" in err, out + err
    assert sorted(os.listdir(outside)) == before and table.path.name in before


def test_a_config_dir_pointer_that_is_not_absolute_is_damage(tuned, cli):
    ledger = tuned / ".sm120kit" / "ledger.json"
    doc = json.loads(ledger.read_text())
    doc["moe_config_dirs"] = ["../somewhere"]
    ledger.write_text(json.dumps(doc))
    code, _, err = cli("unpatch", "--site", tuned)
    assert code == 2 and "is not an absolute, normalised directory" in err, err
