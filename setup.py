"""Metadata lives in setup.cfg; this file only stamps the commit into a built wheel (tfcompat/_provenance.py),
so an installed wheel names the commit it was built from (``tfcompat report``), and builds the package afresh: a
module an earlier build left in build/lib (one the tree has since moved or removed) does not ride the wheel."""

import datetime
import importlib.util
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class StampedBuild(build_py):
    def run(self):
        shutil.rmtree(os.path.join(self.build_lib, "tfcompat"), ignore_errors=True)  # an earlier build's modules
        super().run()
        spec = importlib.util.spec_from_file_location("_provenance", os.path.join(HERE, "tfcompat", "_provenance.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        commit = module._checkout_commit(os.path.join(HERE, "tfcompat")) or "unknown"
        date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
        target = os.path.join(self.build_lib, "tfcompat", "_provenance.py")
        if os.path.exists(target):
            with open(target, "w") as fh:
                fh.write(module.stamp_text(commit, date, "wheel"))


setup(cmdclass={"build_py": StampedBuild})
