from services.api.main import main

main()
