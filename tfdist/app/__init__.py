"""The command-line application built on the library: `tfdist train | launch | env`.

    cli.py     the `tfdist` command: flags in, one-line errors out (exit status 2)
    train.py   the main job: the reference model on an embedded dataset, a JSON summary
    data.py    its datasets (handwritten digits shipped in digits.csv.gz, synthetic examples)
    launch.py  the local multi-process launcher (a test and single-host tool)

Nothing in `tfdist` outside this package imports it.
"""
