"""Sequence parallelism, one feature in one folder, its modules on the floors of their lifetime (tests/test_rooms.py's
table):

* kernels: ``collectives`` (every rank's tensor gathered, the all-to-alls, written once), ``context`` (context
  parallelism's attention over the whole row's keys and values);
* step time: ``shards`` (every rank's slice checked alike, the whole row's call sliced after).

Its public face is :mod:`..ulysses` and :mod:`..trainer`."""
