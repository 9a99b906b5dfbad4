"""What every ``tfcompat`` command shares: the JSON schema version, the program name, distribution versions."""

import importlib.metadata

#: the version of every command's JSON output (``--json``); keys are only ever added within a version
SCHEMA = 1
_PROG = "tfcompat"


def _dist_version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
