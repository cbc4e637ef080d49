from specdec.experiments.cli import main

main()
