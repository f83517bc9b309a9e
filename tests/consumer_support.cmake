# Steps shared by the consumer tests (install_consumer.cmake, subdirectory_consumer.cmake), which
# build examples/minimal.cpp the ways a user of the library would and run it.

# Runs a command; a non-zero exit stops the script with a FATAL_ERROR naming the step, which
# ctest reports as a failure. The output (stdout and stderr) is left in step_output.
function(run_step name)
  execute_process(COMMAND ${ARGN}
    RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "${name} failed (${result}):\n${output}")
  endif()
  set(step_output "${output}" PARENT_SCOPE)
endfunction()

# Runs a build of examples/minimal.cpp (`how` names the build) and checks its one line of output.
# Further arguments go before the program, e.g. `${CMAKE_COMMAND} -E env VAR=value`.
function(run_minimal how program)
  run_step("run minimal (${how})" ${ARGN} "${program}")
  string(STRIP "${step_output}" step_output)
  if(NOT step_output MATCHES "max \\|flash - standard\\| = ")
    message(FATAL_ERROR "minimal (${how}): expected a line 'max |flash - standard| = ...', "
      "got:\n${step_output}")
  endif()
  message(STATUS "minimal (${how}): ${step_output}")
endfunction()
