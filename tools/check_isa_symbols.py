"""Check that a dispatch build of crfkit._C (CRFKIT_ARCH=dispatch, the default) runs on every
x86-64 CPU: outside the avx2 and avx512 copies of the CPU kernels no function uses an
instruction a baseline x86-64 CPU lacks, and the avx2 copy uses no AVX-512.

    python tools/check_isa_symbols.py [library.so]   (default: the crfkit._C that imports here)

Exit status 0 when the library passes, 1 when it does not (the offending functions listed), 2
when it is no dispatch build (one copy of the kernels: nothing to check) or cannot be read.

Why: every copy of the kernels is compiled from the same sources, so each emits its own
out-of-line copy of the inline functions of torch and the standard library it uses (COMDAT),
and the linker keeps one per name. If it kept the AVX-512 copy, a CPU without AVX-512 would run
it from the baseline code (a SIGILL far from any kernel). setup.py links the baseline objects
first so that their copies win, and csrc/cpu/isa.h keeps crfkit's own code in one namespace per
copy; this script checks the result in the built library.

How: `objdump -d -w` lists every function with its bytes. A function belongs to a copy when its
mangled name holds crfkit::cpu::<level> or crfkit::<level> (also as a template argument, e.g.
at::parallel_for of a kernel's lambda), or when it is a local function of that copy's objects
(readelf -s: e.g. a `[clone .constprop.0]` of an inline function, called only there); every
other function is shared and runs on any CPU.
Shared and baseline functions may hold no VEX (c4 / c5) or EVEX (62) encoded instruction (AVX,
AVX2, FMA, BMI, AVX-512: every instruction -march=x86-64-v3 or v4 adds is VEX or EVEX encoded,
but for lzcnt, movbe and popcnt, checked by name); avx2 functions no EVEX one. The library
must not be stripped (local functions would be attributed to their neighbours).
"""
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections import Counter, defaultdict

LEVEL = re.compile(r"6crfkit(?:3cpu)?(8baseline|4avx2|6avx512|6single)")
LEVEL_NAMES = {"8baseline": "baseline", "4avx2": "avx2", "6avx512": "avx512", "6single": "single"}
FUNCTION = re.compile(r"^(?P<address>[0-9a-f]+) <(?P<name>.+)>:$")
INSTRUCTION = re.compile(r"^\s*[0-9a-f]+:\t(?P<bytes>[0-9a-f ]+?)\s*\t(?P<text>.*)$")
# Prefixes that may precede a VEX / EVEX prefix: segment overrides and the address-size prefix.
_SKIPPED_PREFIXES = {0x26, 0x2E, 0x36, 0x3E, 0x64, 0x65, 0x67}
# x86-64-v2 / v3 instructions without a VEX encoding; GCC emits them only when -march allows.
_LEGACY_ENCODED = {"lzcnt", "movbe", "popcnt"}


def encoding(byte_text: str, text: str) -> str | None:
    """'evex', 'vex', the mnemonic of a legacy-encoded v2 / v3 instruction, or None."""
    data = [int(b, 16) for b in byte_text.split()]
    i = 0
    while i < len(data) and data[i] in _SKIPPED_PREFIXES:
        i += 1
    if i < len(data) and data[i] == 0x62:  # in 64-bit mode always EVEX (BOUND is invalid)
        return "evex"
    if i < len(data) and data[i] in (0xC4, 0xC5):  # in 64-bit mode always VEX (LES / LDS invalid)
        return "vex"
    mnemonic = text.split()[0] if text.split() else ""
    return mnemonic if mnemonic in _LEGACY_ENCODED else None


def level_of(name: str) -> str | None:
    """The copy a function belongs to (baseline, avx2, avx512, single) or None when shared."""
    m = LEVEL.search(name)
    return LEVEL_NAMES[m.group(1)] if m else None


def allowed(level: str | None, kind: str) -> bool:
    if level in ("avx512", "single"):
        return True
    if level == "avx2":
        return kind != "evex"
    return False  # shared or baseline: nothing beyond x86-64


def symbols(library: str) -> dict:
    """{address: level or None} of every function of the library's symbol table (.symtab).

    A global (or weak) function belongs to the copy its name names, else it is shared. A local
    one (a static or anonymous-namespace function, or a local clone of an inline function such
    as `f [clone .constprop.0]` or `f.cold`, which only its own object calls) belongs to the copy
    whose object defined it: the linker lists each object's local symbols after a FILE symbol,
    so a group of locals takes the level its namespaced names share."""
    table = subprocess.run(["readelf", "-sW", library], capture_output=True, text=True, check=True).stdout
    if "Symbol table '.symtab'" not in table:
        raise ValueError(f"{library} has no .symtab (stripped): its local functions cannot be told apart")
    table = table[table.index("Symbol table '.symtab'"):]
    groups = []  # per FILE symbol: [(address, binding, name) of its functions]
    for line in table.splitlines():
        fields = line.split()
        if len(fields) < 8 or not fields[0].endswith(":") or not fields[1].isalnum():
            continue
        kind, binding, name = fields[3], fields[4], fields[7]
        if kind == "FILE":
            groups.append([])
        elif kind == "FUNC" and fields[6] != "UND":
            if not groups:
                groups.append([])
            groups[-1].append((int(fields[1], 16), binding, name))
    levels = {}
    for group in groups:
        named = {level_of(name) for _, binding, name in group if binding == "LOCAL"} - {None}
        group_level = named.pop() if len(named) == 1 else None
        for address, binding, name in group:
            level = level_of(name) or (group_level if binding == "LOCAL" else None)
            if levels.get(address) is None:
                levels[address] = level
    return levels


def check(library: str) -> tuple[Counter, dict]:
    """(functions per level, {function: Counter of forbidden encodings}) of `library`."""
    levels = symbols(library)
    listing = subprocess.run(["objdump", "-d", "-w", library], capture_output=True, text=True, check=True)
    functions: Counter = Counter()
    bad: dict = defaultdict(Counter)
    name, level = None, None
    for line in listing.stdout.splitlines():
        m = FUNCTION.match(line)
        if m:
            name = m["name"]
            level = levels.get(int(m["address"], 16), level_of(name))
            functions[level or "shared"] += 1
            continue
        m = INSTRUCTION.match(line)
        if m is None or name is None:
            continue
        kind = encoding(m["bytes"], m["text"])
        if kind is not None and not allowed(level, kind):
            bad[name][kind] += 1
    return functions, dict(bad)


def demangled(names):
    if not names or shutil.which("c++filt") is None:
        return list(names)
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    return out.stdout.splitlines() if out.returncode == 0 else list(names)


def default_library() -> str:
    import crfkit._C

    return crfkit._C.__file__


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("library", nargs="?", help="the .so to check (default: crfkit._C's)")
    args = parser.parse_args(argv)
    if shutil.which("objdump") is None or shutil.which("readelf") is None:
        print("objdump / readelf not found (binutils)", file=sys.stderr)
        return 2
    library = args.library or default_library()
    try:
        functions, bad = check(library)
    except subprocess.CalledProcessError as error:
        print(f"{error.cmd[0]} failed on {library}: {error.stderr}", file=sys.stderr)
        return 2
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    print(f"{library}: functions per copy of the CPU kernels: {dict(functions)}")
    missing = [level for level in ("baseline", "avx2", "avx512") if functions[level] == 0]
    if missing:
        what = "a build of one copy" if functions["single"] else "stripped, or not crfkit._C"
        print(f"no dispatch build ({what}): no {', '.join(missing)} functions; nothing to check")
        return 2
    if bad:
        print(f"{len(bad)} functions that a CPU below their level may run use its instructions:")
        for name, plain in zip(bad, demangled(list(bad))):
            print(f"  {dict(bad[name])}  {plain[:300]}")
        return 1
    print("ok: shared and baseline code is plain x86-64, the avx2 copy has no AVX-512")
    return 0


if __name__ == "__main__":
    sys.exit(main())
