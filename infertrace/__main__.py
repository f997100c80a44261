"""``python -m infertrace`` = the ``infertrace`` console script."""

from infertrace.cli.app import main

if __name__ == "__main__":
    main()
