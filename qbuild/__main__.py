"""`python -m qbuild` and the `qbuild` script: Ctrl-C is guarded before anything heavy is imported."""


def main() -> None:
    from qbuild.base import process

    process.guard_interrupts()
    try:
        from qbuild.cli import main as cli_main

        cli_main()   # ends the process itself (qbuild.base.process.finish)
    except BaseException as exc:
        if process.interrupted() and not isinstance(exc, SystemExit):   # before the command began: nothing started
            process.leave_interrupted()
        raise


if __name__ == "__main__":
    main()
