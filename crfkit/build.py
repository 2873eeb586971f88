"""Compile crfkit's kernels for the running torch and this CPU, ahead of the first op call:

    python -m crfkit.build [--verbose]

the first-use build (crfkit/_build.py, which says when it runs and why), done now: it compiles
crfkit._C into crfkit's cache ($CRFKIT_CACHE/extensions, default ~/.cache/crfkit/extensions), or
finds it there, and prints crfkit.backend_info() as JSON. Where the installed crfkit has a
crfkit._C for this torch, it builds nothing. A build that failed before is retried. Exit status
1, with the reason (and the build log's path), when it cannot build.
"""
import argparse
import json
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m crfkit.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args(argv)
    import crfkit

    try:
        library = crfkit.build_extension(verbose=args.verbose)
    except RuntimeError as error:
        print(f"crfkit: {error}", file=sys.stderr)
        return 1
    print(f"crfkit._C: {library}", file=sys.stderr)
    print(json.dumps(crfkit.backend_info()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
