"""Render a benchmark JSON as markdown and PNG plots (see specdec_cli.report).

.venv/bin/python scripts/report.py RESULT.json [--out DIR]
"""

from specdec_cli.report import main

if __name__ == "__main__":
    main()
