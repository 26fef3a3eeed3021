"""`tune-moe`: fused-MoE kernel configs for a profile's model, installed where sglang looks."""

from __future__ import annotations

from sm120kit.cli.args import command_parser, common_args, profile_args, target_args
from sm120kit.exit_codes import ExitCode


def register(sub) -> None:
    """tune-moe."""
    p = command_parser(
        sub,
        "tune-moe",
        "tune sglang's Triton fused-MoE kernel for a profile's model on this node; --plan first",
        "Search the fused-MoE kernel configs of the installed sglang for the profile's MoE shape (its model's"
        " config.json and the profile's tp/ep): the space of sglang's own tuning script, pruned to the "
        "configs that fit sm_120's 101376 B of shared memory by compiling the installed release's kernel on "
        "the CPU (with sm120kit's Triton, else the --python environment's); time the rest on this node's GPUs"
        " (one worker per GPU), check each against a reference result, and install the fastest config per "
        "batch size where the installed sglang and Triton look, as a tracked change: `sm120kit status` lists "
        "it, `sm120kit unpatch` removes it. --plan stops before the timing (no GPU needed). A run stopped by "
        "Ctrl-C or --budget keeps the batch sizes it finished; run it again to go on.",
        {
            ExitCode.OK: "--plan: planned, and what sglang loads now fits sm_120; tuned: every batch size "
            "timed and the table installed",
            ExitCode.FINDINGS: "--plan: a config file sglang would load on this GPU does not fit sm_120; "
            "tuned: the budget ran out first (the finished batch sizes are installed; run again to go on)",
            ExitCode.ERROR: "bad input, a profile without a Triton fused MoE, no config.json, no Triton to "
            "compile with (pip install 'sm120kit[tune]'), no GPU for the timing (nothing written)",
            ExitCode.AFTER_CHANGE: "the table was installed, then a later step failed (removing the journal, "
            "writing the output); the message says which",
            ExitCode.INTERRUPTED: "interrupted: the finished batch sizes are kept for the next run, nothing installed",
        },
        func=cmd_tune_moe,
    )
    p.add_argument("profile", metavar="PROFILE", help="the launch profile whose MoE to tune, e.g. kimi-k2-int4")
    p.add_argument(
        "--plan", action="store_true", help="print the shape, the candidates and how many fit sm_120; time nothing"
    )
    p.add_argument(
        "--batch-sizes",
        metavar="LIST",
        help="tokens per forward to tune for, comma-separated (default: sglang's tuner's list, 1 to 4096)",
    )
    p.add_argument("--budget", metavar="TIME", help="stop timing after this long, e.g. 20m, 1h, 90s (default: none)")
    p.add_argument(
        "--gpus", metavar="LIST", help="GPU indices to time on, comma-separated (default: every visible GPU)"
    )
    p.add_argument(
        "--device-name",
        metavar="NAME",
        help='the GPU name sglang sees (torch.cuda.get_device_name), e.g. "NVIDIA RTX PRO 6000 Blackwell '
        'Server Edition": for --plan on a machine without that GPU (default: GPU 0 of this machine)',
    )
    p.add_argument(
        "--config-dir",
        metavar="DIR",
        help="install under DIR ($SGLANG_MOE_CONFIG_DIR, which the profile's env must set) instead of "
        "sglang's package directory",
    )
    p.add_argument("--model-config", metavar="FILE", help="the model's config.json (default: from [model] path)")
    p.add_argument("--jobs", type=int, metavar="N", help="processes compiling for sm_120 (default: one per CPU)")
    p.add_argument("--restart", action="store_true", help="forget the finished batch sizes of an earlier run")
    profile_args(p)
    target_args(p, python_is="the environment whose sglang is tuned (it runs the timing workers)")
    common_args(p, wide=True)


def cmd_tune_moe(args) -> int:
    from pathlib import Path

    from sm120kit import report
    from sm120kit.node import nvml
    from sm120kit.profiles.loader import load_profile
    from sm120kit.target import resolve_target
    from sm120kit.tune import render
    from sm120kit.tune.command import tune_moe
    from sm120kit.tune.options import TuneOptions, parse_batch_sizes, parse_budget, parse_gpus

    options = TuneOptions(
        plan_only=args.plan,
        batch_sizes=parse_batch_sizes(args.batch_sizes),
        budget_s=parse_budget(args.budget),
        gpus=parse_gpus(args.gpus),
        device_name=args.device_name or nvml.gpu_name_here(),
        config_dir=Path(args.config_dir) if args.config_dir else None,
        model_config=Path(args.model_config) if args.model_config else None,
        jobs=args.jobs,
        restart=args.restart,
        python=args.python,
        show_progress=not args.json,
    )
    profile = load_profile(args.profile, args.profile_dir, args.sets)
    result = tune_moe(options, profile, resolve_target(args.python, args.site))
    if args.json:
        report.emit_json(result.as_json())
    else:
        print(render.text(result, report.output_width(args.wide)))
    return result.exit_code
