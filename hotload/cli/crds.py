"""`hotload crds ...`: print, write or check the CustomResourceDefinitions."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hotload.api import names

# Building the pydantic models costs ~0.3 s, so `hotload.api.crds` is imported only when a
# crds command runs, not whenever the parser is built.
_FILES = ", ".join(
    f"{names.GROUP}_{plural}.yaml" for plural in (names.DEPLOYMENT_PLURAL, names.SNAPSHOT_PLURAL)
)
_WRITE_COMMAND = "python -m hotload.api.crds --write"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the `crds` command group."""
    p = sub.add_parser(
        "crds",
        help="print, write or check the HotLoadDeployment and Snapshot CRDs",
        description="The CustomResourceDefinitions of HotLoadDeployment and Snapshot "
        "(hotload.dev/v1alpha1), generated from the pydantic models in hotload.api.models. "
        "Install them with `hotload crds generate | kubectl apply -f -`.",
    )
    s = p.add_subparsers(dest="crds_command", metavar="SUBCOMMAND", required=True)

    generate = s.add_parser(
        "generate",
        help="print the CRDs as YAML, or write them into a folder",
        description="Without --out, print both CRDs as one multi-document YAML stream on "
        "stdout (pipe it to `kubectl apply -f -`). With --out, write "
        f"{_FILES} into that folder.",
    )
    generate.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="folder to write the CRD files into (created if missing), e.g. crds",
    )
    generate.add_argument(
        "--docs",
        type=Path,
        metavar="FILE",
        help="also write the Markdown field reference there (the repository keeps it in "
        "docs/crds.md)",
    )
    generate.set_defaults(func=_generate)

    check = s.add_parser(
        "check",
        help="exit 1 when the committed CRDs or docs differ from the models",
        description="Compare crds/*.yaml and docs/crds.md under --root with "
        "freshly generated ones; print a diff summary and exit 1 when any is missing or out of "
        f"date (fix: `{_WRITE_COMMAND}`), exit 0 when all are current.",
    )
    check.add_argument(
        "--root",
        type=Path,
        default=Path(),
        metavar="DIR",
        help="repository root holding crds/ and docs/ (default: the current directory)",
    )
    check.set_defaults(func=_check)


def _generate(args: argparse.Namespace) -> int:
    from hotload.api import crds

    if args.out is None:
        sys.stdout.write(crds.render_all())
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        for kind in crds.KINDS:
            path = args.out / crds.crd_filename(kind)
            path.write_text(crds.render_crd(kind), encoding="utf-8")
            print(f"wrote {path}", file=sys.stderr)
    if args.docs is not None:
        args.docs.parent.mkdir(parents=True, exist_ok=True)
        args.docs.write_text(crds.render_docs(crds.build_crds()), encoding="utf-8")
        print(f"wrote {args.docs}", file=sys.stderr)
    return 0


def _check(args: argparse.Namespace) -> int:
    from hotload.api import crds

    report = crds.check(args.root)
    if report:
        print("\n".join(report), file=sys.stderr)
        print(
            f"hotload: error: generated files are out of date: run `{crds.WRITE_COMMAND}`",
            file=sys.stderr,
        )
        return 1
    print("CRDs and docs are up to date")
    return 0
