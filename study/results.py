"""RESULTS.md, written by the study commands: each table in a section of its own, between the marker
comments `<!-- begin NAME -->` and `<!-- end NAME -->`, replaced whole by the command that made it
(and appended at the end of the file when the file has no such section yet), everything outside
the markers kept as it is. Above each table: the command line, the date, the machine and the wall
time, so that every number in the file says where it came from.
"""
import os
import platform
import re
import shlex
import time
from dataclasses import fields

import torch

from plumbing import atomic_write_text, check, fmt_duration


def flags(cfg):
    """The flags of cfg (a study's Config) that differ from its defaults, as the command line
    spells them."""
    flag = lambda f, v: (f"--{'' if v else 'no-'}{f.name}" if isinstance(v, bool)  # noqa: E731
                         else f"--{f.name} {shlex.quote(str(v))}")
    return [flag(f, getattr(cfg, f.name)) for f in fields(cfg)
            if getattr(cfg, f.name) != f.default]


def launcher(world):
    """How the command was started: torchrun on `world` ranks, or plain python."""
    return f"torchrun --nproc_per_node={world} " if world > 1 else "python "


def cpu_name():
    """The CPU's model name (/proc/cpuinfo on Linux), else platform's best guess."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device, world=1):
    """One line: the platform, the CPU and its cores, torch's version and threads, the devices."""
    dev = torch.device(device)
    where = (f"{world} × {torch.cuda.get_device_name(dev)}" if dev.type == "cuda"
             else f"{world} × {dev.type}")
    return (f"{platform.platform()}; {cpu_name()} ({os.cpu_count()} cores); torch "
            f"{torch.__version__}, {torch.get_num_threads()} threads per rank; {where}")


def demote(body, top=4):
    """body's markdown headings shifted so that its shallowest is level `top` (at most 6): a
    study's "## The frontier" becomes "#### The frontier", under RESULTS.md's own "## " headings."""
    lines, fence = body.split("\n"), False
    heads = []
    for i, line in enumerate(lines):
        fence ^= line.lstrip().startswith("```")
        m = None if fence else re.match(r"(#+) ", line)
        if m:
            heads.append((i, len(m.group(1))))
    shift = top - min((n for _, n in heads), default=top)
    for i, n in heads:
        lines[i] = "#" * min(n + shift, 6) + lines[i][n:]
    return "\n".join(lines)


def section(name, body, command, wall_s, device, world=1):
    """The text between (and with) NAME's markers: where the table came from, then the table."""
    date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return (f"<!-- begin {name} -->\n"
            f"- Command: `{command}`\n- Date: {date}\n- Machine: {machine(device, world)}\n"
            f"- Wall time: {fmt_duration(wall_s)}\n\n{demote(body.strip())}\n"
            f"<!-- end {name} -->")


def write_section(path, name, body, command, wall_s, device, world=1):
    """Replace section NAME of the markdown file at path by `body` (markdown) under its provenance,
    atomically (plumbing.atomic_write_text: a reader sees the old file or the new one); the file,
    or the section at its end, is created when missing. path "": nothing written. Returns whether
    it wrote."""
    if not path:
        return False
    check(re.fullmatch(r"[A-Za-z0-9_.-]+", name), f"section name {name!r}: letters, digits, _ . -")
    old = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    new = section(name, body, command, wall_s, device, world)
    n_begin, n_end = old.count(begin), old.count(end)
    check(n_begin == n_end <= 1 and (n_begin == 0 or old.index(begin) < old.index(end)),
          f"{path}: section {name!r} needs one {begin!r} before one {end!r} (found {n_begin} "
          f"and {n_end}); fix the markers by hand, nothing was written")
    if n_begin:
        i, j = old.index(begin), old.index(end) + len(end)
        text = old[:i] + new + old[j:]
    else:
        text = (old.rstrip("\n") + "\n\n" if old.strip() else "") + new + "\n"
    if os.path.dirname(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_write_text(path, text)
    return True
