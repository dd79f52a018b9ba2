"""The method registry (``linattn.methods``) on the command line: the recipe scripts' check of an attention
type, the methods' list, the options table of docs/usage.md. Pure Python (no torch): the scripts' check is quick.

    python -m linattn_tools.methods_cli check --role encoder|decoder|cross TYPES  # exit 2 on a bad type
    python -m linattn_tools.methods_cli list [--role ROLE]                        # one name per line
    python -m linattn_tools.methods_cli options-table                              # docs/usage.md's table
"""
import argparse
import sys
from typing import Optional, Sequence

from linattn.config import options_table
from linattn.methods import METHODS, ROLES, layer_types, methods_for


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m linattn_tools.methods_cli",
                                     description=__doc__.split("\n\n")[0].replace("\n", " "))
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="exit 2 with a message unless TYPES is a valid attention type "
                           "(or comma list) for ROLE")
    check.add_argument("--role", choices=ROLES, required=True)
    check.add_argument("types", help="a method name, or a comma list with one type per layer")
    listing = sub.add_parser("list", help="the methods, one per line")
    listing.add_argument("--role", choices=ROLES)
    sub.add_parser("options-table", help="the options table of docs/usage.md")
    args = parser.parse_args(argv)
    if args.command == "check":
        types = [t.strip() for t in args.types.split(",")]
        try:
            layer_types(args.types, len(types), args.role)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    elif args.command == "list":
        print("\n".join(methods_for(args.role) if args.role else METHODS))
    else:
        print(options_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
