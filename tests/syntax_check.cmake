# ctest other_compiler_syntax: each of SOURCES through CXX -fsyntax-only with FLAGS (C++17, OpenMP);
# fails naming every file that does not parse.
set(_failed "")
foreach(src IN LISTS SOURCES)
  execute_process(COMMAND ${CXX} -std=c++17 -fopenmp -fsyntax-only ${FLAGS} ${src}
                  RESULT_VARIABLE rc ERROR_VARIABLE err OUTPUT_QUIET)
  if(NOT rc EQUAL 0)
    message("${src}:\n${err}")
    list(APPEND _failed ${src})
  endif()
endforeach()
list(LENGTH SOURCES n)
if(_failed)
  message(FATAL_ERROR "other_compiler_syntax: ${CXX} rejects: ${_failed}")
endif()
message("other_compiler_syntax: ${n} sources parse under ${CXX}")
