from dtypelab.cli import main

main()
