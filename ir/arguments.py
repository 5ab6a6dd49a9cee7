"""The command lines' shared parser: a usage error is one line, like every other input error."""

from __future__ import annotations

import argparse
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error prints one line (`prog: error: ...; see prog --help`), exit 2, instead
    of the whole usage block above it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")
