from services.encoder.main import main

main()
