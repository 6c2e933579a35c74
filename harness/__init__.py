"""Real servers and images that the test suite and the benchmarks both start.

Not part of the installed package: ``tests/`` (pytest's ``pythonpath``) and
``bench/`` (``python -m bench.NAME`` from the project root) import it from the
checkout. Nothing here imports pytest or the tests.

* :mod:`harness.serverprocs`: a child process that dies with its parent, its
  log's tail, a stop by pid;
* :mod:`harness.s3server`: one ``weed server -s3`` on free 127.0.0.1 ports;
* :mod:`harness.seaweedcluster`: a multi-process SeaweedFS cluster;
* :mod:`harness.registryserver`: Debian's ``docker-registry`` (anonymous,
  Basic or token auth), a token realm, and ``skopeo`` pushes;
* :mod:`harness.ociimages`: OCI image layouts made with ``umoci``/``skopeo``;
* :mod:`harness.guest`: QEMU microVM guests (TCG) with a cached Debian cloud
  kernel and a busybox initramfs, on the drives ``vm up`` hands out.
"""
