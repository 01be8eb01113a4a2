"""Every fenced code block of README.md and docs/**/*.md runs, or is checked, here.

Python blocks (```python, ```py, or a bare ``` block that parses as Python code and is not a shell command) run
on the CPU in a fresh namespace per page, the blocks of one page in order and sharing it (as a reader pastes
them), in a temporary working directory, in one subprocess per page, each block under a time limit.
Shell blocks (```bash, ```sh, ```console, or a bare block starting with a command) are checked, not run: every
CLI of ours they call (``python -m torch_sparse_metal...``/``tsm_dev...``, ``python examples/...`` or
``benchmarks/...``, ``torchrun`` of those, ``torch-sparse-metal...``, ``bash benchmarks/*.sh``) exists, and its
command line goes through the CLI's real argparse parser, which stops the CLI (nothing is trained or written).
Only what depends on the machine is relaxed in that parse: a device need not be available here
(``argtypes.available_device``) and an input path need not exist (``argtypes.existing_path``). Repository
paths a command reads (positional arguments such as ``tests/test_x.py``, ``csrc/cpu/*.cpp``) must exist.
Other blocks (a directory tree, a schema; ```text, ```json, ...) are not code and are only counted.

Conventions, written in the markdown as HTML comments on the line(s) directly above the opening fence:

    <!-- docs-test: skip (REASON) -->
        the block cannot run here (needs a Mac, CUDA, the network, big data, or shows a known bug); REASON
        says which. Skips are reported by reason (``pytest -ra``).
    <!-- docs-test: replace OLD=>NEW; OLD2=>NEW2 -->
        text replacements made before the block runs: small sizes for large ones, fewer steps. Each OLD must
        occur in the block, so a replacement that no longer matches fails instead of silently doing nothing.
    <!-- docs-test: prints -->
        each top-level ``print(...)`` line of the Python block that ends in a comment shows what it prints: the
        line must print exactly the comment's text (the block fails otherwise, and when such a line never runs).

A directive that is not directly followed by a fence, or that is not one of these, fails the page's test. An
unmarked block that fails is a test failure; so is every later block of its page (not run, reported as such).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import glob
import io
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BLOCK_LIMIT_S = 60  # per Python block (the slowest here takes a few seconds)
CLI_LIMIT_S = 60  # per command-line check (imports the CLI's module and parses its arguments)
STARTUP_S = 60  # per subprocess, on top of its blocks' limits (interpreter, torch import on a busy machine)

PY_LANGS = {"python", "py", "python3"}
SHELL_LANGS = {"bash", "sh", "shell", "zsh", "console", "shell-session"}
SHELL_WORDS = {"python", "python3", "pip", "pip3", "bash", "sh", "torchrun", "pytest", "git", "cd", "export",
               "source", ".", "c++", "g++", "gcc", "clang", "clang++", "cmake", "make", "apt-get", "apt", "sudo",
               "xcode-select", "ruff", "conda", "uv", "nvidia-smi", "ncu", "nsys", "curl", "wget", "ls", "cat",
               "echo", "mkdir", "cp", "mv", "rm", "env", "time", "timeout", "brew"}
REPO_PATH = re.compile(r"^(?:\./)?(?:benchmarks|examples|tests|csrc|shaders|torch_sparse_metal|tsm_dev|docs|\.ci)"
                       r"(?:/|$)")
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*?)\s*$")
DIRECTIVE = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
# bash scripts whose first argument is a subcommand forwarding the rest to one of our CLIs: {script: {subcommand:
# (CLI, how many arguments after the subcommand are the script's own)}}
FORWARDERS = {"benchmarks/train_device_run.sh": {"start": ("examples/train_wikitext103.py", 1)}}


# ---------------------------------------------------------------------------------------------------- extraction

@dataclass(frozen=True)
class Block:
    page: str  # path relative to the page root (the repository)
    file: str  # absolute path (tracebacks name it, with the markdown's line numbers)
    line: int  # 1-based line of the opening fence
    lang: str  # the info string's first word, lower case ("" for a bare fence)
    kind: str  # "python", "shell", "text" (a bare block that is neither) or "other" (another language)
    source: str  # the block's text, replacements applied
    skip: str | None = None  # the reason of a skip directive
    problems: tuple[str, ...] = ()  # malformed directives
    prints: bool = False  # a prints directive: top-level print lines must print their comments

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


@dataclass
class Page:
    path: str
    blocks: list[Block] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # directives not directly above a fence, unclosed fences


def doc_pages(root: Path = REPO) -> list[Path]:
    """README.md and docs/**/*.md (the user guide, its subfolders included): the pages whose code blocks a reader
    runs. Measurement logs live in benchmarks/results/, not here."""
    return [p for p in [root / "README.md", *sorted((root / "docs").rglob("*.md"))] if p.is_file()]


def _looks_like_python(text: str) -> bool:
    """Parses as Python and does something (an import, an assignment, a call, a statement with a body): a bare
    name or a number alone (program output, a word) is not taken for code."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return False
    code = (ast.Import, ast.ImportFrom, ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Call, ast.FunctionDef,
            ast.AsyncFunctionDef, ast.ClassDef, ast.For, ast.While, ast.With, ast.If, ast.Try)
    return any(isinstance(node, code) for node in ast.walk(tree))


def _looks_like_shell(text: str) -> bool:
    """The first command (after blank and comment lines) starts with a known program, a path or VAR=value."""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        line = line.removeprefix("$ ")
        word = line.split()[0]
        return (word in SHELL_WORDS or word.startswith(("./", "/", "torch-sparse-metal"))
                or re.match(r"^[A-Za-z_]\w*=", word) is not None)
    return False


def classify(lang: str, text: str) -> str:
    if lang in PY_LANGS:
        return "python"
    if lang in SHELL_LANGS:
        return "shell"
    if lang:
        return "other"
    if _looks_like_shell(text):
        return "shell"
    return "python" if _looks_like_python(text) else "text"


def _apply_directives(directives: list[tuple[int, str]], text: str) -> tuple[str, str | None, bool, list[str]]:
    skip, prints, problems = None, False, []
    for line, body in directives:
        verb, _, rest = body.partition(" ")
        rest = rest.strip()
        if verb == "prints" and not rest:
            prints = True
        elif verb == "skip":
            m = re.fullmatch(r"\((.*\S.*)\)", rest)
            if m is None:
                problems.append(f"line {line}: a skip needs a reason in parentheses: skip (needs a Mac)")
            else:
                skip = m.group(1).strip()
        elif verb == "replace":
            pairs = [p for p in rest.split(";") if p.strip()]
            if not pairs:
                problems.append(f"line {line}: replace needs OLD=>NEW pairs")
            for pair in pairs:
                old, sep, new = pair.partition("=>")
                old, new = old.strip(), new.strip()
                if not sep or not old:
                    problems.append(f"line {line}: {pair.strip()!r} is not OLD=>NEW")
                elif old not in text:
                    problems.append(f"line {line}: replace {old!r}: not in the block")
                else:
                    text = text.replace(old, new)
        else:
            problems.append(f"line {line}: unknown docs-test directive {body!r} (skip (REASON), replace OLD=>NEW "
                            "or prints)")
    return text, skip, prints, problems


def extract(path: Path, root: Path = REPO) -> Page:
    """The fenced code blocks of one markdown page, with their directives applied."""
    rel = path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)
    page = Page(rel)
    lines = path.read_text(encoding="utf-8").splitlines()
    pending: list[tuple[int, str]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        directive = DIRECTIVE.match(line)
        opening = FENCE.match(line)
        if directive:
            pending.append((i + 1, directive.group("body")))
            i += 1
            continue
        if not opening:
            if pending:
                page.problems.append(f"line {pending[0][0]}: docs-test directive not directly above a code fence")
                pending = []
            i += 1
            continue
        indent, fence = len(opening.group("indent")), opening.group("fence")
        lang = (opening.group("info").split() or [""])[0].lower()
        closing = re.compile(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        j = i + 1
        while j < len(lines) and not closing.match(lines[j]):
            j += 1
        if j == len(lines):
            page.problems.append(f"line {i + 1}: code fence never closed")
        body = [re.sub(rf"^ {{0,{indent}}}", "", text) for text in lines[i + 1:j]]
        text = "\n".join(body) + "\n"
        text, skip, prints, problems = _apply_directives(pending, text)
        pending = []
        kind = classify(lang, text)
        if prints and kind != "python":
            problems.append("prints: only a Python block's print lines can be checked")
        page.blocks.append(Block(rel, str(path.resolve()), i + 1, lang, kind, text, skip, tuple(problems),
                                 prints))
        i = j + 1
    if pending:
        page.problems.append(f"line {pending[0][0]}: docs-test directive not directly above a code fence")
    return page


# --------------------------------------------------------------------------------------------- running Python

def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU, also on a machine with a GPU
    env.setdefault("OMP_WAIT_POLICY", "passive")  # as tests/conftest.py: a shared machine's cores
    env.setdefault("TORCH_SPARSE_METAL_TUNE", "0")
    env.setdefault("MPLBACKEND", "Agg")
    return env


def _run_child(mode: str, payload: dict, timeout: float) -> dict:
    """Runs this file as a script in a temporary working directory; returns what it wrote."""
    with tempfile.TemporaryDirectory(prefix="docs-test-") as tmp:
        spec, result = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec.write_text(json.dumps(payload))
        work = Path(tmp) / "work"
        work.mkdir()
        try:
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), mode, str(spec), str(result)],
                                  cwd=work, env=_child_env(), capture_output=True, text=True, timeout=timeout)
            tail = (proc.stdout + proc.stderr)[-3000:]
        except subprocess.TimeoutExpired as exc:
            tail = f"subprocess killed after {timeout:.0f} s\n" + str(exc.output or "")[-2000:]
        done = json.loads(result.read_text()) if result.exists() else {}
        done["output"] = tail
        return done


def run_python_blocks(blocks: list[Block], limit_s: float = BLOCK_LIMIT_S) -> dict[int, dict]:
    """{fence line: {"status": "ok" | "failed" | "not run", "detail": ..., "seconds": ...}} for one page's blocks,
    run in order in one namespace, in one subprocess."""
    payload = {"limit_s": limit_s, "blocks": [{"line": b.line, "where": b.file, "source": b.source,
                                               "expected": _expected_prints(b.source) if b.prints else {}}
                                              for b in blocks]}
    done = _run_child("--run-python", payload, timeout=STARTUP_S + limit_s * len(blocks))
    results = {int(k): v for k, v in done.get("results", {}).items()}
    for b in blocks:  # the subprocess died (or was killed) before it reported this block
        results.setdefault(b.line, {"status": "failed", "seconds": None,
                                    "detail": "no result from the subprocess:\n" + done["output"]})
    return results


class _TimeLimit(BaseException):  # not an Exception: a block's own `except Exception` must not swallow it
    pass


def _on_alarm(signum, frame):
    raise _TimeLimit


@contextlib.contextmanager
def _time_limit(seconds: float):
    if not hasattr(signal, "SIGALRM"):  # the subprocess's own timeout still applies
        yield
        return
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _expected_prints(source: str) -> dict[int, str]:
    """{line in ``source``: the comment's text} of each top-level ``print(...)`` statement that ends in a comment.

    Example: ``print(1 + 1)  # 2`` expects ``2``."""
    import tokenize

    comments = {tok.start[0]: tok.string[1:].strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    return {node.lineno: comments[node.end_lineno] for node in ast.parse(source).body
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name) and node.value.func.id == "print"
            and node.end_lineno in comments}


def _recording_print(where: str, printed: dict[int, list[str]]):
    """``print`` that also records what each line of the file ``where`` printed (by the line of the call)."""
    import builtins

    def recording(*args, **kwargs):
        frame = sys._getframe(1)
        if frame.f_code.co_filename == where and kwargs.get("file") is None:
            text = io.StringIO()
            builtins.print(*args, **{**kwargs, "file": text})
            printed.setdefault(frame.f_lineno, []).append(text.getvalue().rstrip("\n"))
        builtins.print(*args, **kwargs)

    return recording


def _unmet_prints(expected: dict[str, str], printed: dict[int, list[str]], first_line: int) -> str:
    """What the block's print lines printed where it differs from their comments, in words ("" if all match)."""
    wrong = []
    for line, want in sorted((int(k), v) for k, v in expected.items()):
        got = printed.get(first_line + line, [])
        if got != [want]:
            wrong.append(f"line {first_line + line}: the comment says {want!r}, it printed "
                         + (" then ".join(map(repr, got)) if got else "nothing"))
    return "\n".join(wrong)


def _child_run_python(spec: Path, result: Path) -> None:
    payload = json.loads(spec.read_text())
    namespace: dict = {"__name__": "__main__"}
    results: dict[int, dict] = {}
    failed = None
    for block in payload["blocks"]:
        if failed is not None:
            results[block["line"]] = {"status": "not run", "seconds": None,
                                      "detail": f"not run: the block at line {failed} of this page failed"}
            continue
        # leading newlines: tracebacks name the markdown file and its line numbers
        code = "\n" * block["line"] + block["source"]
        printed: dict[int, list[str]] = {}
        if block["expected"]:
            namespace["print"] = _recording_print(block["where"], printed)
        start = time.perf_counter()
        try:
            with _time_limit(payload["limit_s"]):
                exec(compile(code, block["where"], "exec"), namespace)
            detail = _unmet_prints(block["expected"], printed, block["line"])
            status = "failed" if detail else "ok"
        except _TimeLimit:
            status, detail = "failed", f"time limit: still running after {payload['limit_s']} s"
        except BaseException:  # SystemExit and KeyboardInterrupt too: a block must run through
            status, detail = "failed", traceback.format_exc()
        namespace.pop("print", None)
        if status != "ok":
            failed = block["line"]
        results[block["line"]] = {"status": status, "detail": detail,
                                  "seconds": round(time.perf_counter() - start, 3)}
        result.write_text(json.dumps({"results": results}))  # after each block: a crash keeps the earlier ones
    result.write_text(json.dumps({"results": results}))


# ------------------------------------------------------------------------------------------ checking shell blocks

def _strip_comment(line: str) -> str:
    """The line without its shell comment (a # at a word's start, outside quotes)."""
    quote = None
    for k, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1].isspace()):
            return line[:k]
    return line


def shell_commands(text: str, lang: str) -> list[list[str]]:
    """The simple commands of a shell block, in order, with the block's own VAR="..." assignments expanded
    (``$C`` in ``python x.py $C --dense``), environment prefixes and redirections dropped."""
    raw = text.splitlines()
    if lang == "console" or (not lang and any(line.startswith("$ ") for line in raw)):
        kept, more = [], False  # prompt lines and their continuations; the rest is output
        for line in raw:
            if line.startswith("$ ") or more:
                kept.append(line.removeprefix("$ "))
                more = line.rstrip().endswith("\\")
        raw = kept
    logical, current = [], ""
    for line in raw:
        line = _strip_comment(line) if not current else line
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        logical.append(_strip_comment(current + line))
        current = ""
    if current:
        logical.append(current)
    variables: dict[str, str] = {}
    commands: list[list[str]] = []
    for line in logical:
        for name, value in variables.items():
            line = re.sub(rf"\$(?:{name}\b|\{{{name}\}})", lambda _, v=value: v, line)
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, ""
        try:
            tokens = list(lexer)
        except ValueError as exc:
            commands.append(["<unparsable>", f"{line.strip()}: {exc}"])
            continue
        simple: list[str] = []
        skip_next = False
        for token in [*tokens, ";"]:
            if skip_next:
                skip_next = False
            elif token and set(token) <= set("&|;()"):
                assignments = [t for t in simple if re.match(r"^[A-Za-z_]\w*=", t)]
                rest = simple[len(assignments):] if simple[:len(assignments)] == assignments else simple
                if simple and not rest:
                    variables.update(t.split("=", 1) for t in assignments)
                elif rest:
                    while rest and re.match(r"^[A-Za-z_]\w*=", rest[0]):
                        rest = rest[1:]
                    commands.append(rest)
                simple = []
            elif token and set(token) <= set("<>&"):
                skip_next = True  # a redirection and its target
            else:
                simple.append(token)
    return commands


def _unbracket(argv: list[str]) -> list[str]:
    """Usage notation: ``--model [--json model.json]`` is checked with the optional part given."""
    out = []
    for token in argv:
        if token.startswith("[-"):
            token = token[1:]
        if token.endswith("]") and "[" not in token:
            token = token[:-1]
        if token:
            out.append(token)
    return out


def _console_scripts() -> dict[str, str]:
    """name -> module:function of the package's console scripts (setup.py / pyproject.toml)."""
    text = "".join((REPO / name).read_text() for name in ("setup.py", "pyproject.toml") if (REPO / name).exists())
    return dict(re.findall(r"[\"']?(torch-sparse-metal[\w-]*)[\"']?\s*=\s*[\"']?([\w.]+:[\w.]+)", text))


def _bash_script_problems(script: str, args: list[str]) -> tuple[list[str], list[dict]]:
    """A bash script of ours exists, and its subcommands are among its `case` arms; a forwarded command line
    comes back as a CLI to check."""
    path = REPO / script
    if not path.is_file():
        return [f"bash {script}: no such script"], []
    source = path.read_text()
    arms = {arm for group in re.findall(r"^\s*([\w|-]+)\)", source, re.M) for arm in group.split("|")}
    words = [a for a in args if not a.startswith("-")]
    problems, clis = [], []
    if arms and args:
        loop = re.search(r'for\s+(\w+)\s+in\s+"\$@"', source)  # `for arg in "$@"; case "$arg"`: every word
        loops = loop is not None and re.search(rf'case\s+"?\$\{{?{loop.group(1)}\b', source) is not None
        checked = words if loops else words[:1]
        problems += [f"bash {script} {w}: not one of its commands {sorted(arms)}" for w in checked if w not in arms]
    forward = FORWARDERS.get(script, {}).get(args[0] if args else "")
    if forward:
        cli, own = forward
        clis.append({"kind": "script", "target": cli, "argv": args[1 + own:]})
    return problems, clis


def cli_invocations(argv: list[str]) -> tuple[list[str], list[dict]]:
    """Problems found without running anything, and the CLIs of ours a command calls (to parse its arguments)."""
    prog, args = argv[0], argv[1:]
    if prog == "<unparsable>":
        return [f"cannot split the command line {args[0]}"], []
    if re.fullmatch(r"python(3(\.\d+)?)?", prog):
        while args and args[0] in ("-u", "-O", "-OO", "-B", "-E", "-s", "-X", "-W"):
            args = args[2:] if args[0] in ("-X", "-W") else args[1:]
        if not args or args[0] == "-c":
            return [], []
        if args[0] == "-m":
            if len(args) < 2:
                return ["python -m without a module"], []
            module, rest = args[1], args[2:]
            if module == "torch.distributed.run":
                return [], [{"kind": "torchrun", "target": "torchrun", "argv": rest}]
            if module.split(".")[0] in ("torch_sparse_metal", "torch_sparse_metal_tools", "tsm_dev"):
                return [], [{"kind": "module", "target": module, "argv": _unbracket(rest)}]
            return [], []  # pip, venv, pytest, ...: not ours
        script, rest = args[0], args[1:]
        if not REPO_PATH.match(script) and not (REPO / script).is_file():
            return [], []  # the reader's own script (train.py), an absolute path: not ours
        if not (REPO / script).is_file():
            return [f"python {script}: no such file in the repository"], []
        return [], [{"kind": "script", "target": script, "argv": _unbracket(rest)}]
    if prog == "torchrun":
        return [], [{"kind": "torchrun", "target": "torchrun", "argv": args}]
    if prog.startswith("torch-sparse-metal"):
        entry = _console_scripts().get(prog)
        if entry is None:
            declared = sorted(_console_scripts())
            return [f"{prog}: no such console script (setup.py and pyproject.toml declare {declared})"], []
        return [], [{"kind": "entry", "target": entry, "argv": _unbracket(args)}]
    if prog in ("bash", "sh") and args and REPO_PATH.match(args[0]):
        return _bash_script_problems(args[0].removeprefix("./"), args[1:])
    if prog.startswith("./") and REPO_PATH.match(prog[2:]):
        return ([] if (REPO / prog).exists() else [f"{prog}: no such file"]), []
    return [], []


def path_problems(argv: list[str]) -> list[str]:
    """Repository paths a command reads (positional arguments, not an option's value: that may be an output)."""
    problems = []
    for k, token in enumerate(argv[1:], start=1):
        if argv[k - 1].startswith("-"):
            continue
        if REPO_PATH.match(token) and not glob.glob(str(REPO / token)):
            problems.append(f"{token}: no such path in the repository")
    return problems


def check_clis(invocations: list[dict]) -> dict[str, str | None]:
    """{key: None if the CLI took its command line, else why not}, all in one subprocess."""
    unique = {json.dumps(inv, sort_keys=True): inv for inv in invocations}
    if not unique:
        return {}
    payload = {"invocations": unique}
    done = _run_child("--check-cli", payload, timeout=STARTUP_S + CLI_LIMIT_S * len(unique))
    results = done.get("results", {})
    return {key: results.get(key, "no result from the subprocess:\n" + done["output"]) for key in unique}


def _any_device(text: str):
    """A lenient ``available_device``: any well-formed device name (``auto`` too), present here or not."""
    import argparse

    import torch

    if text == "auto":
        return text
    try:
        return torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a device name: {text!r}") from None


class _Parsed(BaseException):  # raised by the patched parse_args: the command line was accepted
    pass


def _relax(parser) -> None:
    """Machine-dependent argument types take any well-formed value: a device need not be present, an input path
    need not exist here. Everything else (option names, choices, value types, required arguments) is as is."""
    import argparse


    lenient = {"torch_sparse_metal_tools.argtypes.available_device": _any_device,
               "torch_sparse_metal_tools.argtypes.existing_path": Path}
    for action in parser._actions:
        name = f"{getattr(action.type, '__module__', '')}.{getattr(action.type, '__qualname__', '')}"
        if name in lenient:
            action.type = lenient[name]
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _relax(sub)


def _error_lines(text: str) -> str:
    """argparse's error line(s) without the usage text before them."""
    errors = [line for line in text.splitlines() if "error" in line.lower()]
    return "\n".join(errors) if errors else text.strip()[-1500:]


def _check_one_cli(kind: str, target: str, argv: list[str], parse_args) -> str | None:
    import runpy

    if kind == "torchrun":
        from torch.distributed.run import get_args_parser
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                args = parse_args(get_args_parser(), argv)
        except SystemExit as exc:
            return f"torchrun {shlex.join(argv)}: exit status {exc.code}: {_error_lines(err.getvalue())}"
        target, argv = args.training_script, list(args.training_script_args)
        if args.no_python:
            return None  # not a Python script: nothing of ours to check
        if args.module:
            kind = "module"
            if target.split(".")[0] not in ("torch_sparse_metal", "torch_sparse_metal_tools", "tsm_dev"):
                return None
        else:
            kind = "script"
            if not REPO_PATH.match(target) and not (REPO / target).is_file():
                return None  # the reader's own script: not ours
            if not (REPO / target).is_file():
                return f"torchrun {target}: no such file in the repository"
    err, out = io.StringIO(), io.StringIO()
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out), _time_limit(CLI_LIMIT_S):
            if kind == "module":
                import importlib.util
                if importlib.util.find_spec(target) is None:
                    return f"python -m {target}: no such module"
                sys.argv = [target, *argv]
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            elif kind == "entry":
                import importlib
                module, _, function = target.partition(":")
                sys.argv = [target, *argv]
                obj = importlib.import_module(module)
                for part in function.split("."):
                    obj = getattr(obj, part)
                obj()
            else:
                path = REPO / target
                sys.argv = [target, *argv]
                sys.path.insert(0, str(path.parent))
                runpy.run_path(str(path), run_name="__main__")
    except _Parsed:
        return None
    except SystemExit as exc:
        if exc.code in (0, None) and "usage:" in out.getvalue():
            return None  # --help
        return f"exit status {exc.code}: {_error_lines(err.getvalue() or out.getvalue())}"
    except _TimeLimit:
        return f"did not reach its argument parser within {CLI_LIMIT_S} s"
    except BaseException:
        return traceback.format_exc()[-2000:]
    finally:
        sys.argv[:], sys.path[:] = saved_argv, saved_path
    return "returned without parsing its command line with argparse (so its flags were not checked)"


def _child_check_cli(spec: Path, result: Path) -> None:
    import argparse

    payload = json.loads(spec.read_text())
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        _relax(self)
        original(self, args, namespace)
        raise _Parsed

    import torch_sparse_metal_tools.argtypes
    import torch_sparse_metal_tools.cli

    # Device checks made through the commands' shared helpers (not as an argparse type) are relaxed the same way.
    torch_sparse_metal_tools.argtypes.available_device = torch_sparse_metal_tools.cli.available_device = _any_device
    results = {}
    for key, inv in payload["invocations"].items():
        argparse.ArgumentParser.parse_args = parse_args
        try:
            results[key] = _check_one_cli(inv["kind"], inv["target"], inv["argv"], original)
        finally:
            argparse.ArgumentParser.parse_args = original
        result.write_text(json.dumps({"results": results}))
    result.write_text(json.dumps({"results": results}))


def shell_block_plan(block: Block) -> tuple[list[str], list[tuple[str, dict]]]:
    """(problems found statically, [(the command as written, a CLI invocation to check)])."""
    problems, plan = [], []
    for argv in shell_commands(block.source, block.lang):
        found, clis = cli_invocations(argv)
        problems += found or path_problems(argv)  # a missing script is reported once
        plan += [(shlex.join(argv), inv) for inv in clis]
    return problems, plan


def shell_block_problems(block: Block, cli_results: dict[str, str | None]) -> list[str]:
    problems, plan = shell_block_plan(block)
    for command, inv in plan:
        outcome = cli_results[json.dumps(inv, sort_keys=True)]
        if outcome is not None:
            problems.append(f"{command}\n    {outcome}")
    return problems


# ------------------------------------------------------------------------------------------------- the tests

PAGES = [extract(p) for p in doc_pages()]
BLOCKS = [b for page in PAGES for b in page.blocks]


@functools.cache
def _page_results(page: str) -> dict[int, dict]:
    blocks = [b for b in BLOCKS if b.page == page and b.kind == "python" and b.skip is None and not b.problems]
    return run_python_blocks(blocks)


@functools.cache
def _cli_results() -> dict[str, str | None]:
    invocations = [inv for b in BLOCKS if b.kind == "shell" and b.skip is None
                   for _, inv in shell_block_plan(b)[1]]
    return check_clis(invocations)


def _ids(blocks: list[Block]) -> list[str]:
    return [b.id for b in blocks]


PYTHON_BLOCKS = [b for b in BLOCKS if b.kind == "python"]
SHELL_BLOCKS = [b for b in BLOCKS if b.kind == "shell"]


@pytest.mark.parametrize("page", PAGES, ids=[p.path for p in PAGES])
def test_page_directives(page: Page):
    """Every docs-test directive is well formed and sits directly above a fence; every fence is closed."""
    problems = page.problems + [f"block at line {b.line}: {p}" for b in page.blocks for p in b.problems]
    assert not problems, f"{page.path}:\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=_ids(PYTHON_BLOCKS))
def test_python_block_runs(block: Block):
    if block.skip is not None:
        pytest.skip(f"docs-test skip: {block.skip}")
    assert not block.problems, f"{block.id}: malformed directives: {block.problems}"
    result = _page_results(block.page)[block.line]
    assert result["status"] == "ok", f"{block.id} {result['status']}:\n{result['detail']}"


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=_ids(SHELL_BLOCKS))
def test_shell_block_commands(block: Block):
    if block.skip is not None:
        pytest.skip(f"docs-test skip: {block.skip}")
    problems = shell_block_problems(block, _cli_results())
    assert not problems, f"{block.id}:\n" + "\n".join(problems)


def test_docs_are_found():
    """The pages and their blocks are found at all (a broken glob or fence parser must not pass as 'no blocks')."""
    assert [p.path for p in PAGES][:1] == ["README.md"] and len(PAGES) > 1
    assert sum(b.page == "README.md" and b.kind == "python" and b.skip is None for b in BLOCKS) >= 2
    assert any(b.kind == "shell" for b in BLOCKS)


# -------------------------------------------------------------------------------------- the harness's own tests

KNOWN_PAGE = '''\
# A page

```python
x = 1
```

```py
y = x + 1
```

```
z = [y] * 2
```

```
python -m torch_sparse_metal_tools.bench --device cpu
```

```bash
C="--steps 5"
python examples/train_wikitext103.py $C --device cpu  # comment
```

```console
$ python -m torch_sparse_metal_tools.tune --help
usage: ...
```

```
pkg/
  module.py     what it does
```

1. a list item:

   ```python
   w = 3
   ```

~~~python
v = 4
~~~

````markdown
```python
not run
```
````

<!-- docs-test: skip (needs a Mac) -->
```python
import torch; torch.ones(1, device="mps")
```

<!-- docs-test: replace 4096=>64; 100=>2 -->
```python
size, steps = 4096, 100
```

```json
{"a": 1}
```
'''


def test_extractor_finds_known_blocks(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(KNOWN_PAGE)
    found = extract(page, tmp_path)
    assert found.problems == []
    assert [(b.line, b.kind) for b in found.blocks] == [
        (3, "python"), (7, "python"), (11, "python"), (15, "shell"), (19, "shell"), (24, "shell"), (29, "text"),
        (36, "python"), (40, "python"), (44, "other"), (51, "python"), (56, "python"), (60, "other")]
    blocks = {b.line: b for b in found.blocks}
    assert blocks[36].source == "w = 3\n"  # the list item's indentation is removed
    assert blocks[51].skip == "needs a Mac" and blocks[3].skip is None
    assert blocks[56].source == "size, steps = 64, 2\n"
    assert shell_commands(blocks[19].source, "bash") == [
        ["python", "examples/train_wikitext103.py", "--steps", "5", "--device", "cpu"]]
    assert shell_commands(blocks[24].source, "console") == [["python", "-m", "torch_sparse_metal_tools.tune", "--help"]]


def test_directive_problems_are_reported(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("<!-- docs-test: skip (orphan) -->\n\ntext\n\n<!-- docs-test: skip -->\n```python\npass\n```\n"
                    "<!-- docs-test: replace 10=>1 -->\n```python\nx = 2\n```\n"
                    "<!-- docs-test: skipp (typo) -->\n```python\npass\n```\n```python\nnever closed\n")
    found = extract(page, tmp_path)
    problems = found.problems + [p for b in found.blocks for p in b.problems]
    assert len(problems) == 5, problems
    assert "not directly above" in problems[0] and "never closed" in problems[1]
    assert "needs a reason" in problems[2] and "not in the block" in problems[3] and "unknown" in problems[4]


def test_a_broken_block_fails_and_stops_its_page(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nx = 1\n```\n\n```python\nassert x == 1  # the namespace is shared\n"
                    "print(undefined_name)\n```\n\n```python\ny = x\n```\n")
    blocks = extract(page, tmp_path).blocks
    results = run_python_blocks(blocks, limit_s=30)
    assert [results[b.line]["status"] for b in blocks] == ["ok", "failed", "not run"]
    assert "NameError" in results[5]["detail"]
    assert f'File "{page}", line 7' in results[5]["detail"]  # the markdown file's line


def test_a_print_line_must_print_its_comment_under_the_prints_directive(tmp_path):
    """Under ``prints``, a top-level print line's trailing comment is what it must print: a mismatch, or a line
    that never runs, fails the block; print lines without a comment and blocks without the directive are free."""
    page = tmp_path / "page.md"
    page.write_text("<!-- docs-test: prints -->\n```python\nn = 52429\nprint(n, round(n / 2**20, 4))  # 52429 0.05\n"
                    "print('free')\n```\n\n"
                    "```python\nprint(n / 2**20)  # 0.05 (no directive: not checked)\n```\n\n"
                    "<!-- docs-test: prints -->\n```python\nprint(52429 / 2**20)  # 0.05\n```\n\n"
                    "<!-- docs-test: prints -->\n```python\nif False:\n    pass\nelse:\n    print(1)\n"
                    "print(2)  # 2\n```\n")
    page_blocks = extract(page, tmp_path).blocks
    assert [b.prints for b in page_blocks] == [True, False, True, True]
    results = run_python_blocks(page_blocks[:2], limit_s=30)
    assert [r["status"] for r in results.values()] == ["ok", "ok"]
    wrong = run_python_blocks(page_blocks[2:3], limit_s=30)[page_blocks[2].line]
    assert wrong["status"] == "failed"
    assert "the comment says '0.05', it printed '0.05000019073486328'" in wrong["detail"]
    assert run_python_blocks(page_blocks[3:], limit_s=30)[page_blocks[3].line]["status"] == "ok"
    assert _expected_prints("x = 1\nprint(x)  # 1\nprint(x)\n") == {2: "1"}


def test_a_block_past_its_time_limit_fails(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nwhile True:\n    pass\n```\n")
    start = time.perf_counter()
    results = run_python_blocks(extract(page, tmp_path).blocks, limit_s=1)
    assert results[1]["status"] == "failed" and "time limit" in results[1]["detail"]
    assert time.perf_counter() - start < 30


def test_cli_check_catches_bad_commands():
    block = Block("t.md", "t.md", 1, "bash", "shell", "\n".join([
        "python examples/train_wikitext103.py --steps 10 --no-such-flag",
        "python examples/train_wikitext103.py --steps ten",
        "python -m torch_sparse_metal.no_such_module",
        "python examples/no_such_example.py",
        "bash benchmarks/train_device_run.sh start run1 --dense --no-such-flag",
        "bash benchmarks/train_device_run.sh launch run1",
        "torchrun --nproc-per-node 2 examples/train_wikitext103.py --no-such-flag",
        "python -m pytest tests/test_no_such_file.py",
        "torch-sparse-metal-no-such-script --x",
        # accepted: devices and input paths this machine lacks; usage brackets; $C; --help
        'C="--device mps --data /no/such/corpus.txt"',
        "python examples/train_wikitext103.py $C --steps 100000 --out runs/x",
        "python -m torch_sparse_metal_tools.selfcheck --model [--json model.json]",
        "python -m torch_sparse_metal_tools.tune --device cuda:3 --layer 64,32,0.1",
        "torchrun --standalone --nproc-per-node 2 examples/train_wikitext103.py --device cuda --minutes 1",
        "bash benchmarks/train_device_run.sh start run2 --dense --minutes 1",
        "python -m torch_sparse_metal_tools.bench --help",
    ]) + "\n")
    start = time.perf_counter()
    problems = shell_block_problems(block, check_clis([inv for _, inv in shell_block_plan(block)[1]]))
    text = "\n".join(problems)
    assert len(problems) == 9, text
    for expected in ("--no-such-flag", "argument --steps: expected", "no such module",
                     "no_such_example.py: no such file", "not one of its commands",
                     "test_no_such_file.py: no such path", "no such console script"):
        assert expected in text, expected
    assert text.count("unrecognized arguments: --no-such-flag") == 3  # the example, the forwarded one, torchrun's
    assert time.perf_counter() - start < 120  # parsed, not run (100,000 steps)


def test_the_api_reference_gives_each_grouped_argument_its_own_entry(monkeypatch):
    """The API reference's parameter table looks each documented name up in the signature for its default; an entry
    naming several parameters (``device, dtype: ...``) is found nowhere and was shown "required". The griffe hook
    splits such entries, continuation lines included, and leaves other sections alone."""
    import importlib.util
    import types

    # griffe is the docs extra's package; the hook's text transform needs none of it
    monkeypatch.setitem(sys.modules, "griffe", types.SimpleNamespace(Extension=object, Object=object))
    spec = importlib.util.spec_from_file_location("griffe_examples", REPO / "docs" / "hooks" / "griffe_examples.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    text = ("Summary.\n\n    Args:\n        in_features, out_features, bias: as ``nn.Linear``.\n"
            "        device, dtype (optional): as ``nn.Linear``. On the meta\n            device nothing is drawn.\n\n"
            "        generator: a CPU generator.\n\n    Returns:\n        a, b: both.\n")
    split = hook.split_grouped_parameters(text)
    assert split == ("Summary.\n\n    Args:\n        in_features: as ``nn.Linear``.\n"
                     "        out_features: as ``nn.Linear``.\n        bias: as ``nn.Linear``.\n"
                     "        device (optional): as ``nn.Linear``. On the meta\n            device nothing is drawn.\n"
                     "        dtype (optional): as ``nn.Linear``. On the meta\n            device nothing is drawn.\n\n"
                     "        generator: a CPU generator.\n\n    Returns:\n        a, b: both.\n")
    assert hook.split_grouped_parameters(split) == split


if __name__ == "__main__":  # the subprocesses above
    sys.path[0] = str(REPO)
    {"--run-python": _child_run_python, "--check-cli": _child_check_cli}[sys.argv[1]](Path(sys.argv[2]),
                                                                                      Path(sys.argv[3]))
