"""The built bundle run as Lambda runs it: each function of `sam build`'s output under the Lambda Runtime
Interface Emulator (RIE) with awslambdaric, in a python3.13 venv that holds nothing else.

In a private mount namespace (nothing changes on the machine): the function's built code read-only at
/var/task, its layers unpacked together read-only at /opt (Lambda's layout: /opt/python on the path), a
fresh /tmp, and only the template's environment plus what Lambda itself sets. The bundle is an x86_64
variant of template.yaml (its architecture settings swapped, nothing else) so that it runs on this machine.

    python -m poimen_tools.local.rie build                      # variant, sam build, bytecode (make rie-bundle)
    python -m poimen_tools.local.rie serve AdmissionFunction TABLE_NAME=runs ...

docs/local.md ("The built bundle under the RIE"); tests/integration/test_rie.py; benchmarks/cold_start.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from poimen_tools.local.template import Template

CHECKOUT = Path(__file__).resolve().parents[3]
CACHE = CHECKOUT / ".cache"
# Made by `make rie` (Makefile: the RIE's Go module and awslambdaric's version).
RIE_BINARY = CACHE / "bin" / "aws-lambda-rie"
RUNTIME = CACHE / "rie" / "runtime"
BUILD_ROOT = CACHE / "rie-build"
SAM = CHECKOUT / ".venv-sam" / "bin" / "sam"
# Lambda's python3.13 runtime: the bytecode tag every .py of the bundle must have a .pyc for.
BYTECODE_TAG = "cpython-313"
# The settings of template.yaml that name the architecture: the function's and each layer's.
_ARCHITECTURE = re.compile(
    r"(?m)^(\s*(?:Architectures|CompatibleArchitectures): \[)arm64(\])|^(\s*BuildArchitecture: )arm64$"
)
# Where the checkout's .cache (the RIE, the runtime's venv) is seen inside the namespace.
SANDBOX_CACHE = "/mnt/poimen-cache"
# Mounted inside the namespace before the runtime starts: $1 the task root, $2 the /opt image, $3 the
# checkout's .cache, then the command. All three are staged under /mnt first, so a checkout below /var or
# /tmp (a CI clone in /tmp) stays reachable once fresh ones replace them.
_SANDBOX = f"""set -e
mkdir -p /mnt
mount -t tmpfs -o mode=0755 tmpfs /mnt
mkdir /mnt/task /mnt/opt {SANDBOX_CACHE}
mount --bind "$1" /mnt/task
mount --bind "$2" /mnt/opt
mount --bind "$3" {SANDBOX_CACHE}
mount -o remount,ro,bind {SANDBOX_CACHE}
mount -t tmpfs -o mode=0755 tmpfs /var
mkdir /var/task /var/runtime
mount --bind /mnt/task /var/task
mount -o remount,ro,bind /var/task
mount --bind /mnt/opt /opt
mount -o remount,ro,bind /opt
umount /mnt/task /mnt/opt
mount -t tmpfs -o mode=1777 tmpfs /tmp
cd /var/task
shift 3
exec "$@"
"""
_INIT_REPORT = re.compile(r"INIT REPORT\(durationMs: ([0-9.]+)\)")
# An invocation's platform lines, which the RIE prints as text whatever the function's LoggingConfig: Lambda
# logs them as platform.start and platform.report (and, in text, END), system logs at INFO, none of which a
# SystemLogLevel of WARN sends to CloudWatch Logs ("Log-level filtering",
# https://docs.aws.amazon.com/lambda/latest/dg/monitoring-cloudwatchlogs-log-level.html).
_PLATFORM_INFO_LINE = re.compile(r"(START|END|REPORT) RequestId: ")
# The emulator's own diagnostics ("03 Dec 2026 10:58:57,821 [INFO] (rapid) INVOKE START(...)"): no log group gets them.
_EMULATOR_LINE = re.compile(r"\d\d \w{3} \d{4} [\d:,]+ \[\w+\] \(rapid\) ")
# CloudWatch Logs counts a log event as "the sum of all event messages in UTF-8, plus 26 bytes for each log
# event" (https://docs.aws.amazon.com/AmazonCloudWatchLogs/latest/APIReference/API_PutLogEvents.html); ingestion
# is billed by the GB (https://aws.amazon.com/cloudwatch/pricing/).
LOG_EVENT_OVERHEAD_BYTES = 26
INVOCATIONS = "/2015-03-31/functions/function/invocations"


class RieError(RuntimeError):
    """The emulator, its runtime or the bundle is missing or did not start."""


def x86_64_variant(template_text: str) -> str:
    """template.yaml with its architecture settings (Globals, each layer's two) set to x86_64, nothing else."""
    variant, count = _ARCHITECTURE.subn(lambda m: f"{m[1]}x86_64{m[2]}" if m[1] else f"{m[3]}x86_64", template_text)
    layers = template_text.count("Type: AWS::Serverless::LayerVersion")
    if count != 1 + 2 * layers or "arm64" in variant:
        raise RieError(f"expected 1 + 2 per layer ({layers}) architecture settings, found {count}")
    return variant


def runtime_python() -> Path:
    """The runtime's interpreter: python3.13 of the awslambdaric venv."""
    python = RUNTIME / "bin" / "python"
    if not (python.exists() and RIE_BINARY.exists()):
        raise RieError("the RIE or its runtime is missing: run `make rie` (.cache/bin, .cache/rie)")
    return python


def _base_python() -> Path:
    """The python3.13 the runtime venv was made from (sam build and compileall run it)."""
    config = dict(line.split(" = ", 1) for line in (RUNTIME / "pyvenv.cfg").read_text().splitlines() if " = " in line)
    return Path(config["home"]) / "python3.13"


def compile_bytecode(python: Path, *trees: Path) -> None:
    """What `make build` does to .aws-sam/build: unchecked-hash .pyc beside every .py, as read-only /opt needs."""
    command = [str(python), "-m", "compileall", "-q", "-f", "-j", "0", "--invalidation-mode", "unchecked-hash"]
    subprocess.run([*command, *map(str, trees)], check=True, capture_output=True)


def build_bundle(
    template: Path = CHECKOUT / "template.yaml", root: Path = BUILD_ROOT, *, bytecode: bool = True
) -> Path:
    """The x86_64 variant of `template`, built by `sam build` under `root` (its cache kept), then compiled to
    bytecode as `make build` does (`bytecode=False`: as sam build leaves it). Returns the build directory
    (its template.yaml, one directory per function and layer)."""
    runtime_python()
    root.mkdir(parents=True, exist_ok=True)
    variant = root / "template.yaml"
    variant.write_text(x86_64_variant(template.read_text()))
    build = root / "build"
    shutil.rmtree(root / "opt", ignore_errors=True)
    python = _base_python()
    env = {
        **os.environ,
        "PATH": f"{python.parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
        "SAM_CLI_TELEMETRY": "0",
        "AWS_REGION": os.environ.get("AWS_REGION", "us-east-1"),
        "AWS_DEFAULT_REGION": os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
    }
    config = template.parent / "samconfig.toml"  # language_extensions, for template.yaml's Fn::ForEach
    result = subprocess.run(
        [
            str(SAM),
            "build",
            "--template",
            str(variant),
            "--base-dir",
            str(template.parent),
            "--build-dir",
            str(build),
            "--cache-dir",
            str(root / "cache"),
            "--cached",
            *(["--config-file", str(config)] if config.exists() else []),
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise RieError(f"sam build of the x86_64 variant failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    if bytecode:
        compile_bytecode(python, *(path for path in build.iterdir() if path.is_dir()))
    return build


@dataclass(frozen=True)
class FunctionBundle:
    """One function of a built bundle, as template.yaml declares it (Globals applied)."""

    name: str
    task_root: Path
    layers: tuple[Path, ...]
    handler: str
    timeout: int
    memory: int
    template: Template

    def environment(self, values: Mapping[str, str]) -> dict[str, str]:
        """The template's variables: its literals and parameter defaults, `values` for the rest (a table name
        for a `!Ref`, a URL for an `!Sub`). A variable left without a value, or a value for a variable the
        template does not declare, is an error: the function sees exactly the template's set."""
        declared = self.template.function_environment(self.name, {})
        merged = {
            **self.template.document.get("Globals", {}).get("Function", {}).get("Environment", {}).get("Variables", {}),
            **self.template.properties(self.name).get("Environment", {}).get("Variables", {}),
        }
        unknown = set(values) - set(merged)
        missing = set(merged) - set(declared) - set(values)
        if unknown or missing:
            raise RieError(f"{self.name}: no such variable {sorted(unknown)}; no local value for {sorted(missing)}")
        return {**declared, **values}

    @property
    def logging_config(self) -> dict[str, str]:
        """The function's LoggingConfig (LogFormat, ApplicationLogLevel, SystemLogLevel), as the template sets it."""
        return dict(self.template.properties(self.name).get("LoggingConfig", {}))

    def log_events(self, log: str) -> list[str]:
        """The log events Lambda would send to CloudWatch Logs of `log`, a stretch of what the function's RIE
        printed: each line one event, but the emulator's own and the platform lines the function's
        SystemLogLevel keeps from CloudWatch (the RIE prints them whatever the level)."""
        config = self.logging_config
        filtered = config.get("LogFormat") == "JSON" and config.get("SystemLogLevel") == "WARN"
        return [
            line
            for line in log.splitlines()
            if not _EMULATOR_LINE.match(line) and not (filtered and _PLATFORM_INFO_LINE.match(line))
        ]

    def ingested_log_bytes(self, log: str) -> int:
        """What CloudWatch Logs would ingest, and bill, of `log`: each of its log_events' UTF-8 bytes plus
        LOG_EVENT_OVERHEAD_BYTES."""
        return sum(len(event.encode()) + LOG_EVENT_OVERHEAD_BYTES for event in self.log_events(log))


def functions(build: Path) -> dict[str, FunctionBundle]:
    """Every function of the built bundle in `build`, by logical id."""
    template = Template(build / "template.yaml")
    function_globals = template.document.get("Globals", {}).get("Function", {})
    found = {}
    for name, resource in template.resources.items():
        if resource["Type"] != "AWS::Serverless::Function":
            continue
        properties = resource["Properties"]
        layers = [*function_globals.get("Layers", []), *properties.get("Layers", [])]
        found[name] = FunctionBundle(
            name=name,
            task_root=build / properties["CodeUri"],
            layers=tuple(build / template.properties(layer["Ref"])["ContentUri"] for layer in layers),
            handler=properties["Handler"],
            timeout=int(properties.get("Timeout", function_globals.get("Timeout", 3))),
            memory=int(properties.get("MemorySize", function_globals.get("MemorySize", 128))),
            template=template,
        )
    return found


def opt_image(function: FunctionBundle) -> Path:
    """The function's layers extracted into one tree, in order, as Lambda extracts them into /opt (hard links)."""
    image = function.task_root.parent.parent / "opt" / function.name
    if not image.exists():
        partial = image.with_name(f"{image.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        for layer in function.layers:
            shutil.copytree(layer, partial, copy_function=_link_over, dirs_exist_ok=True)
        partial.rename(image)
    return image


def _link_over(source: str, target: str) -> None:
    """A later layer's file replaces an earlier one's, as in /opt."""
    if os.path.lexists(target):
        os.unlink(target)
    os.link(source, target)


def lambda_variables(function: FunctionBundle, runtime: Mapping[str, str]) -> dict[str, str]:
    """What Lambda's python3.13 runtime sets itself, then `runtime`: what Lambda gives each function too
    (region, the role's credentials), and here the local endpoints (AWS_ENDPOINT_URL_<SERVICE>). A JSON
    LoggingConfig reaches the runtime as AWS_LAMBDA_LOG_FORMAT and AWS_LAMBDA_LOG_LEVEL ("Log-level filtering",
    https://docs.aws.amazon.com/lambda/latest/dg/monitoring-cloudwatchlogs-log-level.html), which awslambdaric
    and Powertools read; the RIE knows no LoggingConfig."""
    logging = function.logging_config
    json_logs = (
        {"AWS_LAMBDA_LOG_FORMAT": "JSON", "AWS_LAMBDA_LOG_LEVEL": logging.get("ApplicationLogLevel", "INFO")}
        if logging.get("LogFormat") == "JSON"
        else {}
    )
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin:/opt/bin",
        "LANG": "en_US.UTF-8",
        "TZ": ":UTC",
        "PYTHONPATH": "/opt/python/lib/python3.13/site-packages:/opt/python",
        "LAMBDA_TASK_ROOT": "/var/task",
        "LAMBDA_RUNTIME_DIR": "/var/runtime",
        "_HANDLER": function.handler,
        "AWS_EXECUTION_ENV": "AWS_Lambda_python3.13",
        "AWS_LAMBDA_FUNCTION_NAME": function.name,
        "AWS_LAMBDA_FUNCTION_VERSION": "$LATEST",
        "AWS_LAMBDA_FUNCTION_MEMORY_SIZE": str(function.memory),
        "AWS_LAMBDA_FUNCTION_TIMEOUT": str(function.timeout),  # the RIE's, for its timeout
        **json_logs,
        **runtime,
    }


def sandbox_command(function: FunctionBundle, *command: str) -> list[str]:
    """`command` run in a private mount namespace with the function's layout (read-only /var/task and /opt).
    Not root: in a user namespace of its own too, where the kernel lets users make one."""
    return [
        "unshare",
        *(["--user", "--map-root-user"] if os.geteuid() != 0 else []),
        "--mount",
        "--propagation",
        "private",
        "--",
        "sh",
        "-c",
        _SANDBOX,
        "sandbox",
        str(function.task_root),
        str(opt_image(function)),
        str(CACHE),
        *map(_inside, command),
    ]


def _inside(argument: str) -> str:
    """A path under the checkout's .cache as the namespace sees it (SANDBOX_CACHE); any other argument as is."""
    prefix = f"{CACHE}/"
    return f"{SANDBOX_CACHE}/{argument.removeprefix(prefix)}" if argument.startswith(prefix) else argument


def run_in_sandbox(
    function: FunctionBundle, values: Mapping[str, str], runtime: Mapping[str, str], code: str
) -> subprocess.CompletedProcess[str]:
    """Python `code` run by the runtime's interpreter where the function runs: same layout, same environment."""
    env = {**lambda_variables(function, runtime), **function.environment(values)}
    command = sandbox_command(function, str(runtime_python()), "-c", code)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=False)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def invoke(url: str, event: Any, timeout: float) -> Any:
    """POST `event` to an RIE's invoke URL; the function's answer (JSON)."""
    if not url.startswith("http://127.0.0.1:"):
        raise RieError(f"not an emulator's invoke URL on loopback: {url}")
    request = urllib.request.Request(url, data=json.dumps(event).encode(), method="POST")  # noqa: S310 (checked above)
    with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 (checked above)
        return json.loads(response.read() or b"null")


@dataclass
class RunningFunction:
    """One function in its own RIE; initialised (INIT) by its first invocation, as the RIE does."""

    function: FunctionBundle
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{INVOCATIONS}"

    def invoke(self, event: Any, timeout: float | None = None) -> Any:
        """The function's answer to `event` (JSON), through the RIE's invoke API."""
        return invoke(self.url, event, timeout or self.function.timeout + 30)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def init_duration_ms(self) -> float | None:
        """INIT REPORT's duration (the RIE's own REPORT line carries a placeholder for it)."""
        found = _INIT_REPORT.search(self.log())
        return float(found[1]) if found else None

    def stop(self) -> int:
        """SIGTERM to the RIE, which ends its runtime; its exit status."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        return self.process.returncode


@contextmanager
def running(
    function: FunctionBundle,
    values: Mapping[str, str],
    runtime: Mapping[str, str],
    log_dir: Path,
    *,
    init_caching: bool = False,
) -> Iterator[RunningFunction]:
    """`function` in its own RIE (its own ports), with the template's environment (`values` for what only
    a deploy knows) and `runtime` as Lambda would set it; stopped on exit."""
    started = start(function, values, runtime, log_dir, init_caching=init_caching)
    try:
        yield started
    finally:
        started.stop()


def start(
    function: FunctionBundle,
    values: Mapping[str, str],
    runtime: Mapping[str, str],
    log_dir: Path,
    *,
    init_caching: bool = False,
    port: int | None = None,
) -> RunningFunction:
    """`function` in an RIE of its own, listening; see `running`. With `init_caching`, as SnapStart
    initialises it: the runtime runs the before-snapshot hooks, then waits for a restore the RIE never makes."""
    python = runtime_python()
    env = {**lambda_variables(function, runtime), **function.environment(values)}
    options = ["--enable-init-caching"] if init_caching else []
    if init_caching:
        env["AWS_LAMBDA_INITIALIZATION_TYPE"] = "snap-start"
    port = port or free_port()
    command = sandbox_command(
        function,
        str(RIE_BINARY),
        *options,
        # Two functions at once need two runtime API addresses, not only two invoke ports.
        "--runtime-api-address",
        f"127.0.0.1:{free_port()}",
        "--runtime-interface-emulator-address",
        f"127.0.0.1:{port}",
        str(python),
        "-m",
        "awslambdaric",
        function.handler,
    )
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{function.name}-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    started = RunningFunction(function, process, port, log_path)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RieError(f"{function.name}: the RIE exited with {process.returncode}:\n{started.log()[-3000:]}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return started
        time.sleep(0.02)
    started.stop()
    raise RieError(f"{function.name}: the RIE did not listen on 127.0.0.1:{port}")


def _serve(arguments: argparse.Namespace) -> int:
    bundle = functions(BUILD_ROOT / "build").get(arguments.function)
    if bundle is None:
        print(
            f"rie: no function {arguments.function} in {BUILD_ROOT / 'build'} (run `make rie-bundle`)", file=sys.stderr
        )
        return 2
    values = dict(pair.split("=", 1) for pair in arguments.variables)
    # Lambda gives the function its region and role credentials; here, the caller's, and its endpoints.
    runtime = {name: value for name, value in os.environ.items() if name.startswith("AWS_")}
    # SIGTERM as Ctrl-C: either way the RIE (a session of its own) is stopped with this process.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    function = start(bundle, values, runtime, BUILD_ROOT / "logs", port=arguments.port)
    try:
        print(f"{bundle.name} (log {function.log_path}): curl -d @event.json {function.url}", flush=True)
        return function.process.wait()
    except KeyboardInterrupt:
        return function.stop()
    finally:
        function.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m poimen_tools.local.rie", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build", help="the x86_64 variant of template.yaml, built and compiled (.cache/rie-build)")
    serve = commands.add_parser("serve", help="one built function in the RIE until interrupted")
    serve.add_argument("function", help="its logical id in template.yaml")
    serve.add_argument("variables", nargs="*", metavar="NAME=VALUE", help="template variables only a deploy knows")
    serve.add_argument("--port", type=int, default=9000, help="the invoke API's port on 127.0.0.1 (9000)")
    arguments = parser.parse_args(argv)
    try:
        if arguments.command == "build":
            print(build_bundle())
            return 0
        return _serve(arguments)
    except RieError as error:
        print(f"rie: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
