"""`fnscale.global_batch`'s replica check options (the check itself, across processes, is run
by tests/test_rows.py's 2-process job)."""
import numpy as np
import pytest

import fnscale as fs


@pytest.mark.parametrize("bad, match", [
    (dict(check="yes"), r"check='yes'\): expected None, True or False"),
    (dict(check_every=0), r"check_every=0\): expected an int >= 1"),
    (dict(check_every=2.0), r"check_every=2.0\): expected an int >= 1")])
def test_check_arguments_are_checked(bad, match):
  sh = fs.batch_sharding(fs.make_mesh({"data": 8}))
  with pytest.raises(fs.DistributedArgumentError, match=match):
    fs.global_batch(np.zeros((8, 2)), sh, **bad)
