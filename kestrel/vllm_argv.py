"""vLLM's command-line forms, rewritten into plain flags before argparse sees them, as `vllm serve` reads them:
--config FILE.yaml (its keys are flags; the command line wins over the file), --flag_name for --flag-name,
-O3 / -O 3 / -O=3 for --optimization-level 3, and dotted JSON flags: --limit-mm-per-prompt.image 2 and
--compilation-config.cudagraph_capture_sizes+ 1,2 become one --limit-mm-per-prompt '{"image": 2}' each."""
from __future__ import annotations

import json
import re

from kestrel.errors import ConfigError

_OPTIMIZATION_LEVELS = ("0", "1", "2", "3")
_FLAG = re.compile(r"--?[A-Za-z]")  # an option, not a negative number such as -1 or -0.5


def rewrite(argv: list[str], known: set[str] = frozenset()) -> list[str]:
    """``known``: the option strings of the subcommand's parser (a YAML false becomes --no-KEY where it has one)."""
    argv = _with_config_file(list(argv), known)
    return _merge_dotted(_plain_names(argv, levels="--optimization-level" in known or not known))


def _with_config_file(argv: list[str], known: set[str]) -> list[str]:
    at = next((i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")), None)
    if at is None:
        return argv
    if argv[at] == "--config":
        if at + 1 >= len(argv):
            raise ConfigError("--config needs a YAML file")
        path, rest = argv[at + 1], argv[at + 2:]
    else:
        path, rest = argv[at].split("=", 1)[1], argv[at + 1:]
    if any(a == "--config" or a.startswith("--config=") for a in rest):
        raise ConfigError("--config is given twice: give one YAML file")
    head = argv[:at]
    # the file's flags go after the subcommand (and a positional model) so that the command line wins
    lead = 2 if head[:1] == ["serve"] and len(head) > 1 and not head[1].startswith("-") else min(1, len(head))
    from_file = config_file_args(path, known, model_on_command_line=lead == 2)
    return head[:lead] + from_file + head[lead:] + rest


def config_file_args(path: str, known: set[str] = frozenset(), model_on_command_line: bool = False) -> list[str]:
    """A YAML mapping of long flag names (with or without --, dashes or underscores) to values -> flags."""
    import yaml

    if not path.endswith((".yaml", ".yml")):
        raise ConfigError(f"--config {path}: the file must be YAML (.yaml or .yml)")
    try:
        with open(path) as f:
            config = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not YAML ({' '.join(str(e).split())})") from None
    if config is None:
        return []
    if not isinstance(config, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values, e.g. 'max-model-len: 4096'")
    out: list[str] = []
    for key, value in config.items():
        flag = "--" + str(key).lstrip("-").replace("_", "-")
        if flag in ("--model", "--model-tag") and model_on_command_line:
            continue  # the command line's model wins, as in vLLM
        if value is None:
            continue
        if isinstance(value, bool):
            if value:
                out.append(flag)
            elif "--no-" + flag[2:] in known:
                out.append("--no-" + flag[2:])
        elif isinstance(value, list):
            if value:
                out += [flag, *(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value)]
        elif isinstance(value, dict):
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def _plain_names(argv: list[str], levels: bool = True) -> list[str]:
    """``levels``: the parser has --optimization-level (-O forms are left alone otherwise)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--help="):  # vLLM's help search (--help=ModelConfig): the whole help here
            out.append("--help")
        elif arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg.partition("=")
            stem, dot, path = name[2:].partition(".")
            out.append("--" + stem.replace("_", "-") + dot + path + eq + value)
        elif levels and arg.startswith("-O") and arg != "-O":
            out += ["--optimization-level", arg[3:] if arg[2:3] == "=" else arg[2:]]
        elif levels and arg == "-O" and i + 1 < len(argv) and argv[i + 1] in _OPTIMIZATION_LEVELS:
            out.append("--optimization-level")
        else:
            out.append(arg)
        i += 1
    return out


def _merge_dotted(argv: list[str]) -> list[str]:
    out: list[str] = []
    merged: dict[str, dict] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if not (_FLAG.match(arg) and "." in name):
            out.append(arg)
            i += 1
            continue
        if "=" in arg:
            value_text = arg.split("=", 1)[1]
        elif i + 1 < len(argv):
            value_text = argv[i + 1]
            i += 1
        else:
            raise ConfigError(f"{name} needs a value")
        i += 1
        append = name.endswith("+")
        flag, *keys = name.rstrip("+").split(".")
        if not all(keys):
            raise ConfigError(f"{name}: expected --flag.key value (e.g. --limit-mm-per-prompt.image 2)")
        value = value_text.split(",") if append else _json_or_text(value_text)
        node = merged.setdefault(flag, {})
        for key in keys[:-1]:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        last = keys[-1]
        if append and isinstance(node.get(last), list):
            node[last] += value
        else:
            node[last] = value
    for flag, value in merged.items():
        out += [flag, json.dumps(value)]
    return out


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        pass
    from kestrel.config import parse_token_count

    try:
        return parse_token_count(text)  # 80k, 1M as vLLM's dotted values take them
    except Exception:
        return text
