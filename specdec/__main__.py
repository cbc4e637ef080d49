from specdec.experiments.app import main

main()
