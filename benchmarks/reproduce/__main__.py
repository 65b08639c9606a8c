from benchmarks.reproduce.main import main

main()
