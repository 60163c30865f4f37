from qbuild.cli import main

main()
